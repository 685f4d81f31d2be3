"""Running cases: the case and its training session, the verification, timing and memory passes, and the executors
(in-process, isolated, Ray, ranks) that write result rows."""
