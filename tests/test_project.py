"""The project's basics stay consistent: one version, the SPDX license, the URLs functx's
messages name, the changelog and citation in step with the version."""

from __future__ import annotations

import importlib.metadata
import pathlib
import re

import pytest

import functx
from functx.core.errors import ISSUES

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
ROOT = pathlib.Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_version_is_written_once_and_installed_as_written():
    project = PYPROJECT["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "functx.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.dev\d+|rc\d+)?", functx.__version__)
    assert importlib.metadata.version("functx") == functx.__version__


def test_license_is_an_spdx_expression_with_its_file():
    project = PYPROJECT["project"]
    assert project["license"] == "BSD-3-Clause"
    assert project["license-files"] == ["LICENSE"]
    assert "BSD 3-Clause License" in (ROOT / "LICENSE").read_text()
    assert not any(c.startswith("License ::") for c in project["classifiers"])  # PEP 639: one or the other


def test_the_issue_tracker_messages_name_is_the_projects():
    assert PYPROJECT["project"]["urls"]["Issues"] == ISSUES


def test_changelog_and_citation_follow_the_version():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in changelog
    assert f"## [{functx.__version__}] - " in changelog
    citation = (ROOT / "CITATION.cff").read_text()
    assert re.search(rf"^version: {re.escape(functx.__version__)}$", citation, re.M)


def test_contributing_release_checklist_and_issue_templates_exist():
    for name in ("CONTRIBUTING.md", "RELEASING.md"):
        assert (ROOT / name).stat().st_size > 500, name
    templates = sorted(p.name for p in (ROOT / ".github" / "ISSUE_TEMPLATE").iterdir())
    assert templates == ["bug.md", "missing_batching_rule.md", "performance.md"]
