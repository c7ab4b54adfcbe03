"""Check the built documentation site (`site/`, from `mkdocs build`) in headless Chromium, as
a reader meets it: each page below loads without a JavaScript error, a failed request or a
request to another host, shows its content, and is photographed (viewport screenshots into
`--screenshots`); and the site's own scripts work on the rendered pages:

- the home page's search: "jacrev" finds the API entry first, and a pasted error message
  finds its row of the error catalogue first;
- an API page: the copy buttons copy examples without `>>>` prompts and printed results;
- the error catalogue: a pasted message finds its row first (the finder's top link);
- the coverage page: the long tables filter and sort, and the page is no longer a
  hundred-thousand-pixel scroll;
- a tutorial page: the output the tutorial printed at build time is shown.

Chromium: `$FUNCTX_CHROMIUM`, else `chromium` / `chromium-browser` / `google-chrome` on the
PATH (Debian: `apt-get install chromium`), driven by Playwright (`pip install -e '.[docs]'`).
.ci/run installs both. Exit 1 on any problem, 2 when no Chromium can be found.

Run after `mkdocs build`:
    .venv/bin/python scripts/check_site_browser.py site --screenshots site-screenshots
"""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import pathlib
import shutil
import sys
import threading
import urllib.parse

# page -> text its article must contain
PAGES = {
    "": "vmap",
    "api/transforms/": "Differences from torch.func",
    "tutorials/per_sample_gradients/": "when this site was built",
    "errors/": "Error catalogue",
    "coverage/": "Not vectorized, refused or failing",
}
PASTED_MESSAGE = "ValueError: vmap: chunk_size should be None or greater than 0. (got 0)"
EXPECTED_ROW = "e-vmap-chunk_size-should-be-none-or-greater-than"
COVERAGE_HEIGHT_LIMIT = 40_000  # px; it was about 125,000 with every table in full


def chromium() -> str | None:
    found = os.environ.get("FUNCTX_CHROMIUM")
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = found or shutil.which(name)
    return found


def _serve(site: pathlib.Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def _first_search_result(page, query: str) -> str | None:
    """The first result's link (its path) after typing `query` into the site's search."""
    box = page.locator("input.md-search__input")
    box.fill("")
    box.focus()
    page.keyboard.type(query, delay=2)
    try:
        page.wait_for_selector("li.md-search-result__item a", timeout=10_000)
    except Exception:
        return None
    page.wait_for_timeout(1000)  # the results settle (the error row comes from a fetch)
    first = page.locator("li.md-search-result__item a").first
    link = urllib.parse.urlparse(urllib.parse.urljoin(page.url, first.get_attribute("href") or ""))
    return link.path.lstrip("/") + (f"#{link.fragment}" if link.fragment else "")


def _interactions(page, path: str) -> list[str]:
    """The site's scripts at work on one page: what is wrong (empty: all good)."""
    problems = []
    if path == "":
        found = _first_search_result(page, "jacrev")
        if not (found or "").startswith("api/transforms/"):
            problems.append(f"searching 'jacrev' gives {found!r} first, not the API entry")
        found = _first_search_result(page, PASTED_MESSAGE)
        if found != f"errors/#{EXPECTED_ROW}":
            problems.append(f"searching the pasted message gives {found!r} first, not errors/#{EXPECTED_ROW}")
        page.keyboard.press("Escape")
    if path == "api/transforms/":
        copied = page.eval_on_selector_all(
            "button[data-clipboard-target][data-clipboard-text]", "bs => bs.map(b => b.getAttribute('data-clipboard-text'))")
        if not copied:
            problems.append("no copy button was prepared by copy_prompts.js")
        elif any(">>>" in text for text in copied):
            problems.append("a copy button still copies '>>>' prompts")
    if path == "errors/":
        finder = page.locator(".error-finder input")
        if finder.count() != 1:
            return problems + ["the error finder is missing"]
        finder.fill(PASTED_MESSAGE)
        first = page.locator(".error-finder li a").first
        href = first.get_attribute("href") if first.count() else None
        if href != f"#{EXPECTED_ROW}":
            problems.append(f"the finder's top link for {PASTED_MESSAGE!r} is {href}, not #{EXPECTED_ROW}")
        else:
            first.click()
            if not page.evaluate(f"document.getElementById({EXPECTED_ROW!r}).matches(':target')"):
                problems.append("following the finder's link does not target the row")
    if path == "coverage/":
        height = page.evaluate("document.documentElement.scrollHeight")
        if height > COVERAGE_HEIGHT_LIMIT:
            problems.append(f"the coverage page is {height} px tall (limit {COVERAGE_HEIGHT_LIMIT})")
        filters = page.locator(".functx-table-filter input")
        if filters.count() < 2:
            return problems + [f"{filters.count()} filter boxes on the coverage page (the per-op and per-overload tables need one each)"]
        table = page.locator("table[data-functx-long]").first
        visible = "t => Array.from(t.tBodies[0].rows).filter(r => r.style.display !== 'none').length"
        everything = table.evaluate(visible)
        filters.first.fill("nonzero")
        shown = table.evaluate(visible)
        if not 1 <= shown < everything:
            problems.append(f"filtering the per-op table by 'nonzero' shows {shown} of {everything} rows")
        filters.first.fill("")
        table.locator("thead th").first.click()
        table.locator("thead th").first.click()  # descending: the last op name first
        names = table.evaluate("t => Array.from(t.tBodies[0].rows).map(r => r.cells[0].textContent)")
        if names != sorted(names, key=str.lower, reverse=True) and names[0] < names[-1]:
            problems.append("clicking the op column's header does not sort the rows")
    return problems


def check(site: pathlib.Path, screenshots: pathlib.Path, executable: str) -> list[str]:
    from playwright.sync_api import sync_playwright

    screenshots.mkdir(parents=True, exist_ok=True)
    server, base = _serve(site)
    problems: list[str] = []
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])
            for path, expected in PAGES.items():
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                seen: list[str] = []
                page.on("pageerror", lambda error, seen=seen: seen.append(f"JavaScript error: {error}"))
                page.on("console", lambda m, seen=seen: seen.append(f"console error: {m.text}") if m.type == "error" else None)
                page.on("requestfailed", lambda r, seen=seen: seen.append(f"request failed: {r.url}"))

                def outside(route, seen=seen):
                    seen.append(f"request to another host: {route.request.url}")
                    route.abort()

                page.route(lambda url: not url.startswith(base), outside)
                response = page.goto(base + path, wait_until="networkidle")
                if response is None or not response.ok:
                    seen.append(f"HTTP {response.status if response else 'no response'}")
                text = page.inner_text("article") if page.locator("article").count() else ""
                if len(text) < 200 or expected not in text:
                    seen.append(f"its article is empty or lacks {expected!r} ({len(text)} characters)")
                seen += _interactions(page, path)
                name = (path.strip("/").replace("/", "_") or "home") + ".png"
                page.screenshot(path=str(screenshots / name))
                problems += [f"/{path}: {problem}" for problem in seen]
                page.close()
            browser.close()
    finally:
        server.shutdown()
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", nargs="?", default="site", type=pathlib.Path)
    parser.add_argument("--screenshots", default=pathlib.Path("site-screenshots"), type=pathlib.Path)
    args = parser.parse_args()
    executable = chromium()
    if executable is None:
        print("check_site_browser: no Chromium found (set FUNCTX_CHROMIUM, or apt-get install chromium)")
        return 2
    problems = check(args.site, args.screenshots, executable)
    for problem in problems:
        print(f"check_site_browser: {problem}")
    if not problems:
        print(f"check_site_browser: {len(PAGES)} pages render in Chromium without errors, their scripts work; "
              f"screenshots in {args.screenshots}/")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
