-- wrk script: POST an OpenAI streaming chat request.
-- BENCH_AUTH adds an Authorization header (LiteLLM needs its master key);
-- BENCH_SESSIONS=1 sends a fresh X-Session-Id per request (session load +
-- save on every request, the worst case for the store);
-- BENCH_STICKY=1 sends a fresh X-Bench-User per request (a rollout's sticky
-- key: the bucket hash runs on every request, half the buckets on each arm).
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local auth = os.getenv("BENCH_AUTH")
if auth and auth ~= "" then
  wrk.headers["Authorization"] = "Bearer " .. auth
end
wrk.body = '{"model":"tiny","stream":true,"max_tokens":16,'
  .. '"messages":[{"role":"user","content":"Hello there, how are you?"}]}'
local sessions = os.getenv("BENCH_SESSIONS") == "1"
local sticky = os.getenv("BENCH_STICKY") == "1"
local counter = 0

function setup(thread)
  thread:set("tid", tostring(math.random(1, 1000000000)))
end

request = function()
  if sessions then
    counter = counter + 1
    wrk.headers["X-Session-Id"] = "bench-" .. tid .. "-" .. counter
  end
  if sticky then
    counter = counter + 1
    wrk.headers["X-Bench-User"] = "user-" .. tid .. "-" .. counter
  end
  return wrk.format()
end
