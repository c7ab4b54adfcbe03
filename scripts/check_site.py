"""Check the built documentation site (`site/`, from `mkdocs build`) the way a reader meets
it, short of a browser: the home page, an API page and a tutorial page each have content;
every script and stylesheet a page loads is the site's own file and exists (no request to
another host: the site works offline, fonts included); and every JavaScript file the pages
load parses (`node --check`), so a syntax error cannot break the copy buttons or search.

scripts/check_site_browser.py then renders the pages in headless Chromium (runtime errors,
the scripts at work, screenshots); this check needs no browser.

Run after `mkdocs build`:  .venv/bin/python scripts/check_site.py [SITE_DIR]
"""

from __future__ import annotations

import html.parser
import pathlib
import shutil
import subprocess
import sys

PAGES = {  # page -> text its main content must contain
    "index.html": "vmap",
    "api/transforms/index.html": "Differences from torch.func",
    "tutorials/per_sample_gradients/index.html": "when this site was built",  # its printed output
}


class _Page(html.parser.HTMLParser):
    """The assets a page loads and the text of its main content (`<article>`)."""

    def __init__(self):
        super().__init__()
        self.assets: list[str] = []
        self.text: list[str] = []
        self._in_article = 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "script" and attrs.get("src"):
            self.assets.append(attrs["src"])
        if tag == "link" and attrs.get("rel") in ("stylesheet", "preconnect", "preload") and attrs.get("href"):
            self.assets.append(attrs["href"])
        if tag == "article":
            self._in_article += 1

    def handle_endtag(self, tag):
        if tag == "article":
            self._in_article -= 1

    def handle_data(self, data):
        if self._in_article:
            self.text.append(data)


def check(site: pathlib.Path) -> list[str]:
    problems = []
    scripts = set()
    for page, expected in PAGES.items():
        path = site / page
        if not path.exists():
            problems.append(f"{page}: missing")
            continue
        parsed = _Page()
        parsed.feed(path.read_text(encoding="utf-8"))
        text = " ".join(" ".join(parsed.text).split())
        if len(text) < 200 or expected not in text:
            problems.append(f"{page}: its content is empty or lacks {expected!r} ({len(text)} characters)")
        for asset in parsed.assets:
            if asset.startswith(("http://", "https://", "//")):
                problems.append(f"{page}: loads {asset} from another host (the site must work offline)")
                continue
            local = (path.parent / asset.split("?")[0].split("#")[0]).resolve()
            if not local.exists():
                problems.append(f"{page}: loads {asset}, which the build did not produce")
            elif local.suffix == ".js":
                scripts.add(local)
    node = shutil.which("node")
    if node is None:
        print("check_site: node is not installed; the scripts' syntax is not checked")
    else:
        for script in sorted(scripts):
            result = subprocess.run([node, "--check", str(script)], capture_output=True, text=True)
            if result.returncode != 0:
                problems.append(f"{script.relative_to(site)}: does not parse: {result.stderr.strip()[:300]}")
    return problems


def main() -> int:
    site = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "site")
    problems = check(site)
    for problem in problems:
        print(f"check_site: {problem}")
    if not problems:
        print(f"check_site: {len(PAGES)} pages with content, their assets local and present, their scripts parse")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
