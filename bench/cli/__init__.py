"""The command line (`python -m bench`): parses, dispatches to the layers below, prints."""
