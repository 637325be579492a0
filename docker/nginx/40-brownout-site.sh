#!/bin/sh
# Entrypoint hook of the official nginx image (run from /docker-entrypoint.d/
# before nginx starts). Renders the repository's nginx/brownout.conf — mounted
# read-only at /etc/brownout-nginx/brownout.conf, the single source of truth —
# into /etc/nginx/conf.d/default.conf (replacing the image's default site),
# with its `server 127.0.0.1:8080;` upstream pointed at the compose service.
#
# `resolve` (nginx >= 1.27.3) plus Docker's embedded DNS (127.0.0.11) make
# nginx follow the brownout container when it is recreated with a new address.
#
# Environment: BROWNOUT_UPSTREAM (default brownout:8080), BROWNOUT_RESOLVER
# (default 127.0.0.11), BROWNOUT_NGINX_SOURCE, BROWNOUT_NGINX_SITE (paths).
set -eu

src="${BROWNOUT_NGINX_SOURCE:-/etc/brownout-nginx/brownout.conf}"
dst="${BROWNOUT_NGINX_SITE:-/etc/nginx/conf.d/default.conf}"
upstream="${BROWNOUT_UPSTREAM:-brownout:8080}"
resolver="${BROWNOUT_RESOLVER:-127.0.0.11}"
pattern='^[[:space:]]*server[[:space:]]+127\.0\.0\.1:8080;[[:space:]]*$'

count="$(grep -Ec "$pattern" "$src" || true)"
if [ "$count" != 1 ]; then
    echo "$0: expected exactly one 'server 127.0.0.1:8080;' line in $src, found $count" >&2
    exit 1
fi

tmp="$dst.tmp.$$"
{
    echo "# Rendered from $src by $0 at container start: edit that file, not this one."
    echo "resolver $resolver valid=10s ipv6=off;"
    echo
    # Values through the environment: `awk -v` would process their backslashes.
    PATTERN="$pattern" UPSTREAM="$upstream" awk '
        $0 ~ ENVIRON["PATTERN"] {
            indent = $0
            sub(/[^[:space:]].*$/, "", indent)
            print indent "zone brownout_upstream 64k;"
            print indent "server " ENVIRON["UPSTREAM"] " resolve;"
            next
        }
        { print }
    ' "$src"
} >"$tmp"
mv "$tmp" "$dst"
echo "$0: $dst: upstream $upstream, rendered from $src"
