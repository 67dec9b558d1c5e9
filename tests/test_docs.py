"""Every ``python`` code block in the README and the docs runs (blocks of a page in order).

One test class per page: under ``--dist loadscope`` (pyproject) a class is a work unit of its
own, so the pages spread over the xdist workers.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def blocks(page: Path) -> list[str]:
    return BLOCK.findall(page.read_text())


def run_blocks(page: Path) -> int:
    """Run the page's ``python`` blocks in order, in one namespace; the number run (a block
    that raises fails the test)."""
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    code_blocks = blocks(page)
    for i, code in enumerate(code_blocks):
        exec(compile(code, f"{page.name}[block {i}]", "exec"), namespace)
    return len(code_blocks)


def unit_class(page: Path) -> type:
    """``Test_<page>``, holding the one test ``test_code_blocks_run`` of ``page``."""

    def test_code_blocks_run(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        monkeypatch.chdir(tmp_path)
        assert run_blocks(page) == len(blocks(page)) > 0

    body = {"test_code_blocks_run": test_code_blocks_run, "__module__": __name__}
    return type(f"Test_{page.stem}", (), body)


for _page in PAGES:
    if blocks(_page):
        _cls = unit_class(_page)
        assert _cls.__name__ not in globals(), _page  # one class per page name
        globals()[_cls.__name__] = _cls
