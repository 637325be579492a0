"""`brownout replay`: what would this policy have done with that traffic?

A recording of the flight recorder (`proxy.telemetry.recorder`), or a
synthetic scenario, is replayed on a virtual clock through the real
control code (`proxy.control`) under a candidate policy and a baseline,
with the backends simulated from what the recording saw:

    trace    the recording parsed: arrivals, attempts, probes, tiers, policy
    world    the backends' condition over time and their load model
    sim      one replay: the control objects driven by events in a heap
    report   figures, fidelity against the recording, comparison, --fail-on
    html     the self-contained page (tier timelines, load and latency)
    scenarios  synthetic traces (engine-death, overload-burst, ...)
    main     the command's glue
"""
