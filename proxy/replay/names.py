"""The names `brownout replay` takes on its command line (no imports: the
CLI's parser is built without loading the replay)."""

SCENARIOS = ("engine-death", "overload-burst", "slow-prefill", "flapping", "fallback-down")
FAIL_ON = ("client_errors", "maintenance_answers", "shed", "ttft_p95")
