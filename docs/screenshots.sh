#!/usr/bin/env bash
# The built site as a person sees it: screenshots of the home page, a guide (at its picture), an API page and a
# search, taken by headless Chromium from the site `mkdocs build --strict` makes, served on localhost. Not run in
# CI (only this script needs Chromium: Debian's package `chromium`). Look at them after changing the theme, the
# Markdown extensions, docs/stylesheets/ or a page's layout.
#
#   docs/screenshots.sh [OUT_DIR]      # OUT_DIR defaults to site-shots/ (gitignored); prints the PNGs' paths
#
# Environment: CHROMIUM (default chromium, chromium-browser or google-chrome from PATH), MKDOCS (default
# .venv/bin/mkdocs, else mkdocs from PATH), SHOT_TIMEOUT (seconds a page gets to be ready, default 30).
set -euo pipefail

cd "$(dirname "$0")/.."
out=${1:-site-shots}
mkdir -p "$out"
out=$(cd "$out" && pwd)

chromium=${CHROMIUM:-}
if [[ -z $chromium ]]; then
    for c in chromium chromium-browser google-chrome; do
        if command -v "$c" >/dev/null; then chromium=$c; break; fi
    done
fi
if [[ -z $chromium ]] || ! command -v "$chromium" >/dev/null; then
    echo "screenshots.sh: no Chromium found: install Debian's package chromium (apt-get install -y chromium)" \
         "or set CHROMIUM to a Chromium/Chrome binary" >&2
    exit 1
fi
mkdocs=${MKDOCS:-}
if [[ -z $mkdocs ]]; then
    if [[ -x .venv/bin/mkdocs ]]; then mkdocs=.venv/bin/mkdocs; else mkdocs=mkdocs; fi
fi
if [[ -x .venv/bin/python ]]; then python=.venv/bin/python; else python=python3; fi

tmp=$(mktemp -d)
server_pid=
cleanup() {
    if [[ -n $server_pid ]]; then
        kill "$server_pid" 2>/dev/null || true
        wait "$server_pid" 2>/dev/null || true
    fi
    rm -rf "$tmp"
}
trap cleanup EXIT

echo "screenshots.sh: building the site (mkdocs build --strict)" >&2
NO_MKDOCS_2_WARNING=1 "$mkdocs" build --strict --quiet -d "$tmp/site"

# A port the OS says is free, and the site served on it until this script exits.
port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$python" -m http.server "$port" --bind 127.0.0.1 --directory "$tmp/site" >"$tmp/server.log" 2>&1 &
server_pid=$!
for _ in $(seq 100); do
    if "$python" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/')" 2>/dev/null; then
        break
    fi
    sleep 0.1
done

# The API page: the strategies' reference where the site has one, else the reference's first page.
api=/reference/
if [[ -f $tmp/site/reference/strategies/index.html ]]; then api=/reference/strategies/; fi

# Nothing beyond localhost: these flags keep Chromium from reaching for updates, sync and QUIC (slow or failing on
# a closed network). Chromium's sandbox refuses to run as root.
flags=(--headless --disable-gpu --disable-quic --no-first-run --disable-background-networking
       --disable-component-update --disable-sync --hide-scrollbars --window-size=1280,900
       --user-data-dir="$tmp/profile")
if [[ $(id -u) == 0 ]]; then flags+=(--no-sandbox); fi

# Chromium's own DevTools pipe (--remote-debugging-pipe: commands in on fd 3, replies out on fd 4, JSON messages
# ended by NUL), driven with the standard library: each page is shot once it has loaded, its images are decoded and
# what it waits for is there (the search's results come from a web worker, which --screenshot does not wait for).
"$python" - "$chromium" "http://127.0.0.1:$port" "$out" "$tmp/chromium.log" "$api" "${flags[@]}" <<'PY'
import base64, json, os, subprocess, sys, time

chromium, base, out, log_path, api, *flags = sys.argv[1:]
IMAGE = "article img[src$='pipeline_schedules.png']"
SHOTS = [  # (file name, page, CSS selector to wait for, CSS selector to scroll to or None)
    ("home", "/", "article h1", None),
    ("guide", "/scaling/pipeline/", IMAGE, IMAGE),
    ("api", api, "article h1", None),
    # Material for MkDocs opens its search with the query of ?q= and lists results once the index has loaded.
    ("search", "/?q=pipeline+schedule", ".md-search-result__item", None),
]
TIMEOUT = float(os.environ.get("SHOT_TIMEOUT", "30"))

r_child, w_parent = os.pipe()
r_parent, w_child = os.pipe()


def child_fds():  # in the child, before exec: the pipe's ends at fds 3 and 4, which pass_fds keeps open
    r, w = os.dup(r_child), os.dup(w_child)
    os.dup2(r, 3)
    os.dup2(w, 4)


log = open(log_path, "w")
proc = subprocess.Popen([chromium, *flags, "--remote-debugging-pipe", "about:blank"], pass_fds=(3, 4),
                        preexec_fn=child_fds, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
os.close(r_child)
os.close(w_child)
buf, last_id = b"", 0


def died(method):
    log.flush()
    tail = "".join(open(log_path).readlines()[-20:])
    sys.exit(f"screenshots.sh: Chromium closed its pipe during {method}; the end of its log:\n{tail}")


def send(method, session=None, **params):
    global buf, last_id
    last_id += 1
    message = {"id": last_id, "method": method, "params": params}
    if session:
        message["sessionId"] = session
    try:
        os.write(w_parent, json.dumps(message).encode() + b"\0")
    except BrokenPipeError:
        died(method)
    while True:  # events come in between; skip to this command's reply
        while b"\0" not in buf:
            chunk = os.read(r_parent, 1 << 20)
            if not chunk:
                died(method)
            buf += chunk
        raw, buf = buf.split(b"\0", 1)
        reply = json.loads(raw)
        if reply.get("id") == last_id:
            if "error" in reply:
                sys.exit(f"screenshots.sh: {method}: {reply['error']}")
            return reply["result"]


def evaluate(session, js):
    return send("Runtime.evaluate", session, expression=js, returnByValue=True)["result"].get("value")


late = []
try:
    target = send("Target.createTarget", url="about:blank")["targetId"]
    session = send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
    send("Emulation.setDeviceMetricsOverride", session, width=1280, height=900, deviceScaleFactor=1, mobile=False)
    for name, path, ready, scroll in SHOTS:
        send("Page.navigate", session, url=base + path)
        check = (f"document.readyState === 'complete' && !!document.querySelector({json.dumps(ready)})"
                 " && [...document.images].every(i => i.complete)")
        deadline = time.monotonic() + TIMEOUT
        while not evaluate(session, check):
            if time.monotonic() > deadline:
                late.append(f"{path}: no {ready} after {TIMEOUT:.0f} s")
                break
            time.sleep(0.2)
        if scroll:  # the element at the top, below the header bar
            evaluate(session, f"document.querySelector({json.dumps(scroll)})?.scrollIntoView(); scrollBy(0, -64)")
        time.sleep(0.5)  # the last layout and paint
        png = os.path.join(out, name + ".png")
        with open(png, "wb") as f:
            f.write(base64.b64decode(send("Page.captureScreenshot", session, format="png")["data"]))
        print(png)
        if name == "search":
            found = evaluate(session, "document.querySelector('.md-search-result__meta')?.textContent")
            print(f"screenshots.sh: search {path}: {found}", file=sys.stderr)
finally:
    proc.terminate()
    proc.wait(10)
for line in late:
    print("screenshots.sh: not ready in time, shot as it was:", line, file=sys.stderr)
sys.exit(1 if late else 0)
PY
