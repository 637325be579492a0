"""The output guard: validators on every streamed event and non-streaming body.

- `compiled`: `Guard`, the validators of one policy, compiled once;
- `stream`: `StreamGuard`, fed every region of one streamed response (the
  module docstring has the verdicts and the cost model);
- `rules`: the content rules on the decoded answer text;
- `verdicts`: `Trip`, `GuardVerdict`, `invalid_output_event`.
"""
