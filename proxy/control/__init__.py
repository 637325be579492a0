"""Decisions, no sockets: the tier ladder, breakers, admission, pressure,
shared fleet state and the maintenance/FAQ answer. Names and values in,
decisions out; the I/O that feeds them lives in `proxy.runtime.generation` and
`proxy.pipeline`."""
