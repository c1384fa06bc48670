"""The report page as a person sees it: rendered in headless Chromium, every image loaded and no text wider than the
table that holds it, or wider than the page; a screenshot of the whole page kept beside it.

Chromium runs twice on the page, each time a fresh process with a profile of its own, no network needed: once on a
copy with a probe script appended that measures the laid-out page into the DOM (``--dump-dom``), once on the page
itself for the screenshot, at the height the probe measured."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from dflash.errors import InputError, PreflightError
from dflash.io import atomic_path, atomic_write_text

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
WIDTH = 1280  # CSS pixels: a laptop's window
MAX_HEIGHT = 20000  # Chromium's screenshot grows slow and large past this
TIMEOUT_S = 120

# Runs after every image has loaded or failed (the load event), then writes what it measured into the DOM. A cell
# overflows when its content is wider than its box (text that cannot wrap); a table overflows when it reaches past
# its container's content box (the page's, for the report's tables).
PROBE = """<script>
addEventListener("load", () => {
  const px = 1;
  const images = [...document.images].map(img => ({alt: img.alt, width: img.naturalWidth, complete: img.complete}));
  const overflows = [];
  document.querySelectorAll("table").forEach((table, index) => {
    const container = table.parentElement, style = getComputedStyle(container);
    const right = container.getBoundingClientRect().right - parseFloat(style.paddingRight);
    if (table.getBoundingClientRect().right > right + px)
      overflows.push({table: index, text: "the table is wider than the page", width: table.scrollWidth});
    table.querySelectorAll("th, td").forEach(cell => {
      if (cell.scrollWidth > cell.clientWidth + px)
        overflows.push({table: index, text: cell.textContent.slice(0, 80), width: cell.scrollWidth});
    });
  });
  const out = document.createElement("pre");
  out.id = "dflash-probe";
  out.textContent = JSON.stringify({images, overflows, height: document.documentElement.scrollHeight});
  document.body.appendChild(out);
});
</script>"""


def find_browser() -> str:
    for name in BROWSERS:
        if path := shutil.which(name):
            return path
    raise PreflightError(f"headless Chromium is not installed (looked for {', '.join(BROWSERS)} on PATH): `apt-get install chromium` on Debian or Ubuntu")


def _chromium(browser: str, profile: Path, *args: str) -> subprocess.CompletedProcess:
    # --no-sandbox: root (CI, containers) cannot use Chromium's sandbox; the page is our own file.
    command = [browser, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}", "--hide-scrollbars", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
    if result.returncode != 0:
        raise PreflightError(f"{browser} exited {result.returncode}: {result.stderr.strip().splitlines()[-1:] or ''}")
    return result


def measure(page: Path, browser: str, scratch: Path) -> dict:
    """What the probe measured on ``page`` laid out at ``WIDTH``: ``images`` (alt, natural width), ``overflows``,
    ``height``."""
    text = page.read_text()
    if "</body>" not in text:
        raise InputError(f"{page} is not an HTML page with a </body>: rebuild it (`snakemake --cores 1 report`)")
    probed = scratch / page.name
    probed.write_text(text.replace("</body>", PROBE + "</body>", 1))
    result = _chromium(browser, scratch / "profile", f"--window-size={WIDTH},900", "--virtual-time-budget=10000", "--dump-dom", probed.as_uri())
    found = re.search(r'<pre id="dflash-probe">(.*?)</pre>', result.stdout, re.DOTALL)
    if not found:
        raise PreflightError(f"{browser} rendered {page} but its probe wrote nothing: was the load event reached? {result.stderr[-300:]}")
    return json.loads(html.unescape(found.group(1)))


def check_page(page: Path, screenshot: Path, out: Path) -> dict:
    """Render ``page``: write its screenshot and ``out`` (what was measured, ``ok``); raise, naming each image that
    did not load and each overflowing text, when it is not ok (both files are written first)."""
    if not page.is_file():
        raise InputError(f"{page} does not exist: build it first (`snakemake --cores 1 report`)")
    browser = find_browser()
    with tempfile.TemporaryDirectory(prefix="dflash-browser-") as scratch:
        measured = measure(page, browser, Path(scratch))
        height = min(MAX_HEIGHT, int(measured["height"]))
        # The staging path keeps the screenshot's suffix, which tells Chromium the format.
        with atomic_path(screenshot) as partial:
            _chromium(browser, Path(scratch) / "profile-shot", f"--window-size={WIDTH},{height}", f"--screenshot={partial}", page.resolve().as_uri())
    broken = [image["alt"] or "(no alt)" for image in measured["images"] if not image["width"]]
    problems = [f"image {name} did not load" for name in broken] + [
        f"table {o['table']}: {o['text']!r} overflows ({o['width']} px)" for o in measured["overflows"]
    ]
    verdict = {"page": str(page), "browser": browser, "width": WIDTH, **measured, "screenshot": str(screenshot), "problems": problems, "ok": not problems}
    atomic_write_text(out, json.dumps(verdict, indent=2) + "\n")
    if problems:
        raise InputError(f"{page} rendered in {Path(browser).name} with problems: {'; '.join(problems)} (screenshot: {screenshot})")
    return verdict
