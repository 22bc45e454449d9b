"""`kvpool plan`: size a pool from a request trace (trace.py parses, sim.py replays, cli.py
prints)."""
