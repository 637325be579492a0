"""Ingress: everything a request passes before the pipeline (`Flow`) sees it.

    socket ─► header deadline (listen) ─► router (routes.ROUTES)
           ─► middlewares: request id + log context ─► OpenAI errors ─► path check ─► auth
           ─► handler: body read (size, time, Content-Encoding) ─► parse (validate)
           ─► priority, session context ─► pipeline

- `listen`      the listening socket: closes connections whose request headers
                do not arrive within `server.header_timeout_s` (slow-loris)
- `routes`      the one table of every route: path, methods, handler, auth, stages
- `middleware`  what cuts across every route (request id, errors, paths, auth)
- `paths`       path normalisation rules (pure)
- `headers`     request headers towards a backend: hop-by-hop and entity headers (pure)
- `body`        reading the request body within its limits
- `completions` chat and completion requests up to the pipeline
- `context`     typed per-request keys the middlewares set
"""
