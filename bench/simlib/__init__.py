"""A discrete-event model of the weight broadcast, driving the real broadcast.tracker (bench use only)."""
