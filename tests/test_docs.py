"""The documentation holds together: links resolve, every page is in the site, nothing is missed.

``scripts/test.sh`` builds the site with ``mkdocs build --strict`` as well; these tests are the
fast part of that check, and also cover README.md and CHANGELOG.md, which the site does not build
as pages. They read the Markdown sources only.
"""

from __future__ import annotations

import importlib
import re
import unicodedata
from pathlib import Path
from types import ModuleType

import attrs
import pytest
import yaml

from p2pshard import NodeConfig, TlsFiles

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("**/*.md"))
DOCUMENTS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *PAGES]

_FENCED = re.compile(r"^(```|~~~).*?^\1\s*$", flags=re.M | re.S)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", flags=re.M)


def _prose(text: str) -> str:
    """The text without fenced blocks and code spans, where a ``](...)`` is not a link."""
    return _CODE_SPAN.sub("", _FENCED.sub("", text))


def slug(heading: str) -> str:
    """The anchor a heading gets: Python-Markdown's default, as MkDocs makes it.

    GitHub's slugs agree with it for the headings this project writes (letters, digits, spaces,
    hyphens and punctuation that both drop).
    """
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(document: Path) -> set[str]:
    return {slug(m.group(2)) for m in _HEADING.finditer(_FENCED.sub("", document.read_text()))}


def links(document: Path) -> list[str]:
    return _LINK.findall(_prose(document.read_text()))


def test_the_slug_is_the_one_mkdocs_makes() -> None:
    assert slug("Failover: how fast, and how to make it faster") == (
        "failover-how-fast-and-how-to-make-it-faster"
    )
    assert slug("[tls]") == "tls"
    assert slug("The chaos suite: run it on your own entity types") == (
        "the-chaos-suite-run-it-on-your-own-entity-types"
    )
    assert slug("Re-exported from `membership`") == "re-exported-from-membership"


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(document: Path) -> None:
    broken = []
    for target in links(document):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        resolved = (document.parent / path).resolve() if path else document
        if not resolved.exists():
            broken.append(f"{target}: no file {resolved}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: {resolved.name} has no heading with the anchor #{anchor}")
    assert not broken, f"{document.relative_to(ROOT)}: broken links: {broken}"


def test_the_link_check_finds_a_broken_link(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](#title), [bad](#nowhere) and `[code](x.md)`\n")
    assert links(page) == ["#title", "#nowhere"]
    assert anchors(page) == {"title"}


def _nav_pages(node: object) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [page for item in node for page in _nav_pages(item)]
    if isinstance(node, dict):
        return [page for value in node.values() for page in _nav_pages(value)]
    raise AssertionError(f"mkdocs.yml: unexpected nav entry {node!r}")


def test_every_docs_page_is_in_the_nav_and_every_nav_entry_is_a_page() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = _nav_pages(config["nav"])
    assert len(nav) == len(set(nav)), f"a page is in the nav twice: {nav}"
    pages = {str(p.relative_to(DOCS)) for p in PAGES}
    assert pages - set(nav) == set(), "docs pages missing from mkdocs.yml's nav"
    assert set(nav) - pages == set(), "mkdocs.yml's nav names pages that do not exist"


def test_readme_links_every_docs_page() -> None:
    linked = {
        (ROOT / target.partition("#")[0]).resolve()
        for target in links(ROOT / "README.md")
        if target.startswith("docs/")
    }
    missing = [str(p.relative_to(ROOT)) for p in PAGES if p.resolve() not in linked]
    assert missing == ["docs/changelog.md"], "README.md does not link these pages"


def _settings_keys(cls: type, prefix: str) -> list[tuple[str, str]]:
    """(table, key) for every field of a configuration class, nested tables included."""
    keys = []
    for field in attrs.fields(cls):
        nested = field.type if isinstance(field.type, type) and attrs.has(field.type) else None
        if nested is None and isinstance(field.default, attrs.Factory):  # type: ignore[arg-type]
            factory = field.default.factory
            nested = factory if isinstance(factory, type) and attrs.has(factory) else None
        if field.name == "tls":
            nested = TlsFiles
        if nested is not None:
            keys += _settings_keys(nested, field.name)
        else:
            keys.append((prefix, field.name))
    return keys


def test_the_configuration_reference_lists_every_key() -> None:
    text = (DOCS / "configuration.md").read_text()
    found = re.finditer(r"^## (.*?)\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    sections = {m.group(1): m.group(2) for m in found}
    keys = _settings_keys(NodeConfig, "")
    assert len(keys) > 80
    missing = []
    for table, key in keys:
        section = sections.get(f"[{table}]" if table else "Top level", "")
        if f"| `{key}` |" not in section:
            missing.append(f"{table}.{key}" if table else key)
    assert not missing, f"docs/configuration.md lacks these keys in their table: {missing}"


REFERENCE = {
    "p2pshard": "p2pshard.md",
    "p2pshard.testing": "p2pshard-testing.md",
    "membership": "membership.md",
    "crdt": "crdt.md",
}


def _public_names(module: ModuleType) -> set[str]:
    names = {
        name
        for name, value in vars(module).items()
        if not name.startswith("_") and not isinstance(value, ModuleType)
    }
    names.discard("TYPE_CHECKING")
    if module.__name__ == "p2pshard":
        names.add("PostgresJournal")  # imported on first use
    return names


@pytest.mark.parametrize("package", sorted(REFERENCE))
def test_the_api_reference_covers_every_public_name_and_no_private_one(package: str) -> None:
    text = (DOCS / "reference" / REFERENCE[package]).read_text()
    identifiers = re.findall(r"^::: (\S+)$", text, flags=re.M)
    private = [i for i in identifiers if any(part.startswith("_") for part in i.split("."))]
    assert not private, f"the reference names private modules or names: {private}"
    documented = {i.removeprefix(package + ".") for i in identifiers if i != package}
    reexports = text.partition("documented there:")[2].partition("\n")[0]
    re_exported = set(re.findall(r"`(\w+)`", reexports))
    missing = _public_names(importlib.import_module(package)) - documented - re_exported
    assert not missing, f"docs/reference/{REFERENCE[package]} lacks {sorted(missing)}"
