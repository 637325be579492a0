"""The output guard: validators compiled once per policy, fed every
streamed region and non-streaming body (`core`)."""
