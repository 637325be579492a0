"""The request pipeline: every /v1/* request through the same stages.

    ingress (handlers: auth, body, parse, priority, session context)
      → session load                                     sessions.py
      → route (the ladder: maintenance, or candidates)   runtime.route()
      → attempts, per candidate until one answers:       attempts.py
            admission (primary, when throttling)
            → adapt (model, params, trim; in the deadline) adapt.py
            → backend call (never follows redirects)     call.py
            → relay with the guard                       relay.py, pump.py, passthrough.py
            → rescue (a stream that died mid-answer)     rescue.py
      → session save (choice 0 of a finished answer)     sessions.py
      → finish: one metrics update, one log line         finish.py

Stages return values (`record.AttemptResult`, `record.Terminal`); the retry
rule is `attempts.next_step`; only the outcome inbox (`inbox.Inbox`: breaker,
ladder, pressure, outcome metrics) and `finish` write shared state.
"""

from proxy.pipeline.flow import serve, serve_passthrough
from proxy.pipeline.record import RequestRecord

__all__ = ["RequestRecord", "serve", "serve_passthrough"]
