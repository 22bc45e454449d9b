"""What `kvpool plan` replays (the umbrella CLI's command): trace.py parses Mooncake and
Bailian traces, sim.py replays one through a model of the pool on the cpu tier's own
bookkeeping (store/slots.py)."""
