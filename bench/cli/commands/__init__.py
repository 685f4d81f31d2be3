"""The commands of `python -m bench`, one module each: its name, its line of `--help`, its options and the function
that runs it (`COMMAND`, a bench.cli.command.Command). A command whose work is large runs it from a module beside
this folder (bench.cli.commands_run, commands_analysis, commands_plan, commands_report, commands_anchors), imported
only when the command runs. A new command is a module here and its name in bench.cli.main's list."""
