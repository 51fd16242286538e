"""Builds the documentation site, serves it on localhost and opens pages in headless Chromium at
1280 px wide: a screenshot of each, and a measurement, taken in the page, of everything that does
not fit.

Cut: an element of the content whose content is wider than its box (scrollWidth > clientWidth),
whether it clips it or scrolls it (a reader at 1280 px sees part of a diagram, a code line or a
table's columns either way), and a page wider than the window; 4 px of slack (the padding of an
inline code span that wraps at the end of a line reaches a few pixels past its paragraph). Tables that are still too wide
for the column are to be split into the columns that matter.

    python scripts/check_site.py [--out DIR] [--pages / benchmarks/ ...] [--no-build]

Exit 0 when nothing is cut on any page, 1 with one line per cut element otherwise, 2 when
Chromium or mkdocs is missing. Needs `chromium` (Debian: apt-get install chromium) and the docs
extra. tests/package/test_site.py runs it (skipped, with the reason, without Chromium).
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("", "getting-started/", "benchmarks/", "guides/long-context/")
WIDTH = 1280
MARK = "site-check-report"

# Runs in the page after layout; writes what does not fit into <pre id=MARK> for --dump-dom.
MEASURE_JS = r"""
(function () {
  function where(el) {
    var parts = [];
    for (var e = el; e && e !== document.body && parts.length < 4; e = e.parentElement) {
      var p = e.tagName.toLowerCase();
      if (e.id) p += "#" + e.id;
      else if (e.classList.length) p += "." + Array.from(e.classList).slice(0, 2).join(".");
      parts.unshift(p);
    }
    return parts.join(" > ");
  }
  function text(el) {
    return (el.innerText || "").replace(/\s+/g, " ").trim().slice(0, 70);
  }
  function run() {
    var cut = [];
    var root = document.documentElement;
    if (root.scrollWidth > root.clientWidth + 1) {
      cut.push({what: "page", where: "html", width: root.scrollWidth, box: root.clientWidth,
                text: "the page is wider than the window"});
    }
    var content = document.querySelector(".md-content") || document.body;
    content.querySelectorAll("pre, pre > code, table, img, svg, p, li, div, h1, h2, h3").forEach(
      function (el) {
        if (el.clientWidth === 0) return;
        // a code block scrolls in its code element (Material): measured there, not as its pre
        if (el.tagName === "PRE" && el.querySelector("code")) return;
        var over = el.scrollWidth - el.clientWidth;
        var right = el.getBoundingClientRect().right;
        if (over > SLACK) {
          cut.push({what: el.tagName.toLowerCase(), where: where(el), width: el.scrollWidth,
                    box: el.clientWidth, text: text(el)});
        } else if (right > root.clientWidth + SLACK) {
          cut.push({what: el.tagName.toLowerCase(), where: where(el), width: Math.round(right),
                    box: root.clientWidth, text: "beyond the window: " + text(el)});
        }
      });
    var pre = document.createElement("pre");
    pre.id = "MARK";
    pre.textContent = JSON.stringify({width: root.clientWidth, cut: cut});
    document.body.appendChild(pre);
  }
  if (document.readyState === "complete") run();
  else window.addEventListener("load", run);
})();
""".replace("MARK", MARK).replace("SLACK", "4")


class _Handler(http.server.SimpleHTTPRequestHandler):
    """Serves the built site; an HTML page asked for with ?measure gets the measuring script."""

    def do_GET(self) -> None:
        path, _, query = self.path.partition("?")
        if query != "measure":
            return super().do_GET()
        file = Path(self.translate_path(path))
        if file.is_dir():
            file = file / "index.html"
        html = file.read_text(encoding="utf-8")
        html = html.replace("</body>", f"<script>{MEASURE_JS}</script></body>")
        body = html.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        return None

    def log_message(self, *args: object) -> None:
        pass


def chromium() -> str | None:
    """The Chromium executable, or None."""
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _flags(profile: str) -> list[str]:
    return [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
    ]


def measure(browser: str, url: str, profile: str, height: int = 900) -> dict:
    """What does not fit on the page at `url` (the measuring script's report)."""
    done = subprocess.run(
        [browser, *_flags(profile), f"--window-size={WIDTH},{height}", "--virtual-time-budget=8000",
         "--dump-dom", url + "?measure"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    found = re.search(rf'<pre id="{MARK}">(.*?)</pre>', done.stdout, re.S)
    if found is None:
        raise RuntimeError(f"{url}: no measurement came back ({done.stderr.strip()[-300:]})")
    import html

    return json.loads(html.unescape(found.group(1)))


def screenshot(browser: str, url: str, path: Path, profile: str, height: int = 2000) -> None:
    subprocess.run(
        [browser, *_flags(profile), f"--window-size={WIDTH},{height}", "--virtual-time-budget=8000",
         f"--screenshot={path}", url],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip


def build(site: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(site)],
        cwd=ROOT, env=env, check=True, timeout=900,
    )  # fmt: skip


def check(site: Path, out: Path, pages: tuple[str, ...] = PAGES) -> list[str]:
    """Serves `site`, screenshots and measures each page; one line per cut element."""
    browser = chromium()
    if browser is None:
        raise FileNotFoundError("no Chromium found (Debian: apt-get install chromium)")
    handler = functools.partial(_Handler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    out.mkdir(parents=True, exist_ok=True)
    lines = []
    try:
        with tempfile.TemporaryDirectory(prefix="site-check-") as profile:
            for page in pages:
                url = base + page
                name = page.strip("/").replace("/", "-") or "home"
                screenshot(browser, url, out / f"{name}.png", profile)
                report = measure(browser, url, profile)
                if report["width"] != WIDTH:
                    lines.append(f"/{page}: the window is {report['width']} px, not {WIDTH}")
                lines += [
                    f"/{page}: {c['what']} {c['where']}: {c['width']} px in {c['box']} px: "
                    f"{c['text']!r}"
                    for c in report["cut"]
                ]
    finally:
        server.shutdown()
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "site-check", help="screenshots go here")
    p.add_argument("--pages", nargs="*", default=list(PAGES), help="paths under the site root")
    p.add_argument("--site", type=Path, default=None, help="an already built site (no build)")
    a = p.parse_args(argv)
    if chromium() is None:
        print("check_site: no Chromium found (Debian: apt-get install chromium)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="site-") as tmp:
        site = a.site
        if site is None:
            site = Path(tmp) / "site"
            build(site)
        lines = check(site, a.out, tuple(a.pages))
    for line in lines:
        print(line)
    print(
        f"check_site: {len(a.pages)} pages at {WIDTH} px, {len(lines)} cut; screenshots in {a.out}",
        file=sys.stderr,
    )
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
