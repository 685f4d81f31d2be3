"""The strategies' framework, apart from the plug-ins in strategies/: the plug-in API (`base`), specs and their
composition (`spec`, `composite`), the catalog of what each strategy declares, and helpers that several strategies
share (module names, BatchNorm->activation pairs, sharding, the 8-bit and compiled optimizer updates' memory,
inductor's plan). A plug-in imports the API from `strategies` itself; discovery does not import this package as one."""
