# Sourced by scripts/bench-serve.sh and scripts/router-floor.sh: scenario (a)'s tenants and
# starting/stopping servers on free loopback ports. Needs $bin (the fastlane binary) and $tmp
# (a scratch directory, removed with every server still running by the trap set here).
trap 'kill $(cat "$tmp"/*.pid 2>/dev/null) 2>/dev/null || true; rm -rf "$tmp"' EXIT

# Scenario (a)'s two tenants into $tmp/tenants.toml: quiet (interactive) and flood (batch,
# bucket 600 rpm = 10/s, burst 10, 8 slots).
write_tenants() {
  cat > "$tmp/tenants.toml" <<'TOML'
[[tenant]]
name = "quiet"
keys = ["key-quiet"]
rpm = 600
burst = 10
max_concurrent = 8
tier = "interactive"

[[tenant]]
name = "flood"
keys = ["key-flood"]
rpm = 600
burst = 10
max_concurrent = 8
tier = "batch"
queue = 16
TOML
}

# The router's upstream tenants into $tmp/upstream-tenants.toml: one per tier, keys
# up-interactive and up-batch (`router --upstream-key up-interactive --upstream-batch-key
# up-batch`), limits out of the way (the router is the gate).
write_upstream_tenants() {
  cat > "$tmp/upstream-tenants.toml" <<'TOML'
[[tenant]]
name = "router"
keys = ["up-interactive"]
rpm = 6000000
burst = 100000
max_concurrent = 100000
tier = "interactive"
queue = 100000

[[tenant]]
name = "router-batch"
keys = ["up-batch"]
rpm = 6000000
burst = 100000
max_concurrent = 100000
tier = "batch"
queue = 100000
TOML
}

start() { # name args...: starts `fastlane args... --listen 127.0.0.1:0` (on cores $server_cpus
  # when set), sets $url
  local name=$1 pin=(); shift
  [ -n "${server_cpus:-}" ] && pin=(taskset -c "$server_cpus")
  "${pin[@]}" "$bin" "$@" --listen 127.0.0.1:0 >"$tmp/$name.out" 2>"$tmp/$name.log" &
  echo $! >"$tmp/$name.pid"
  for _ in $(seq 300); do grep -q listening "$tmp/$name.out" 2>/dev/null && break; sleep 0.2; done
  url=$(sed -n 's/^listening on //p' "$tmp/$name.out")
  [ -n "$url" ] || { cat "$tmp/$name.log" >&2; exit 1; }
}

stop() { # name: SIGTERM, then wait for its exit
  kill -TERM "$(cat "$tmp/$1.pid")"; wait "$(cat "$tmp/$1.pid")" || true; rm -f "$tmp/$1.pid"
}
