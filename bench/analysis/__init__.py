"""Analysis of cases beyond one measured row: explain (per module, per checkpoint unit), predict on fake tensors, fit
(the largest batch in a budget)."""
