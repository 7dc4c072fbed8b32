"""The sync client is generated from the async one (tools/async_to_sync.py), so
they cannot drift: the generated files are what the tool makes now, and the tool
does what it says."""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path
from types import ModuleType

import pytest

import pgque

ROOT = Path(__file__).resolve().parent.parent


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("async_to_sync",
                                                  ROOT / "tools" / "async_to_sync.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tool = _tool()


@pytest.mark.parametrize("source", sorted(tool.TWINS))
def test_the_generated_file_is_up_to_date(source: str) -> None:
    target = tool.TWINS[source]
    current = (ROOT / target).read_text(encoding="utf-8")
    assert current == tool.generated(source), (
        f"{target} differs from what tools/async_to_sync.py generates from {source}: "
        "edit the async source, never the generated file, and run `make twins`")


def test_the_readme_names_every_twin() -> None:
    """TWINS is the one list of the twins; README's folder table names each source
    and the module generated from it, so it must follow that list."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for source, target in tool.TWINS.items():
        assert f"`{source}`" in readme, f"README.md does not name {source}"
        assert f"{Path(target).name}`" in readme, f"README.md does not name {target}"


def test_check_mode_reports_a_stale_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "pgque").mkdir()
    (tmp_path / "pgque" / "x_async.py").write_text("async def f() -> None:\n    pass\n")
    monkeypatch.setattr(tool, "ROOT", tmp_path)
    monkeypatch.setattr(tool, "TWINS", {"pgque/x_async.py": "pgque/x.py"})
    assert tool.main(["--check"]) == 1
    assert "+def f() -> None:" in capsys.readouterr().out
    assert tool.main([]) == 0
    assert tool.main(["--check"]) == 0
    generated = (tmp_path / "pgque" / "x.py").read_text()
    assert generated.startswith("# Generated from pgque/x_async.py by tools/async_to_sync.py")


def convert(source: str) -> str:
    """The converted body, without the header."""
    out: str = tool.convert(source, "a.py", "b.py")
    return out.split("\n", 3)[3]


def test_keywords_names_and_layout() -> None:
    source = '''\
import asyncio
import time
from collections.abc import AsyncIterator, Iterable

# An AsyncClient's comment: ``async with client.conn.transaction():``
class AsyncClient:
    """Uses an AsyncConnection; ``await client.send(...)``."""

    async def __aenter__(self) -> AsyncClient:
        self.lock = asyncio.Lock()
        async with self.lock:
            await asyncio_free(1,
                               2)  # stays aligned with its bracket
        return self

    async def rows(self, items: Iterable[int]) -> AsyncIterator[int]:
        async for item in aiter_of(items):
            yield item
'''
    assert convert(source) == '''\
import threading
import time
from collections.abc import Iterable, Iterator

# An Client's comment: ``with client.conn.transaction():``
class Client:
    """Uses an Connection; ``client.send(...)``."""

    def __enter__(self) -> Client:
        self.lock = threading.Lock()
        with self.lock:
            asyncio_free(1,
                         2)  # stays aligned with its bracket
        return self

    def rows(self, items: Iterable[int]) -> Iterator[int]:
        for item in aiter_of(items):
            yield item
'''


def test_markers() -> None:
    source = '''\
# only the async source says this  # async-only
import os
# sync-only: import sys
x = 1  # async-only
'''
    assert convert(source) == "import os\nimport sys\n"


def test_an_async_name_left_over_fails() -> None:
    with pytest.raises(tool.ConversionError, match=r"asyncio \(line 2\)"):
        convert("import os\nasyncio.gather()\n")


def test_the_twins_have_the_same_calls() -> None:
    def public(cls: type) -> dict[str, inspect.Signature]:
        return {name: inspect.signature(value) for name, value in vars(cls).items()
                if callable(value) and (not name.startswith("_") or name == "__init__")}

    sync_calls, async_calls = public(pgque.Client), public(pgque.AsyncClient)
    assert sync_calls.keys() == async_calls.keys()
    for name, signature in sync_calls.items():
        assert str(async_calls[name]).replace("AsyncConn", "Conn").replace(
            "AsyncClient", "Client") == str(signature), name
        assert inspect.iscoroutinefunction(getattr(pgque.AsyncClient, name)) == (
            name != "__init__"), name
    assert {"open_connection_async", "connect_async", "AsyncClient"} <= set(pgque.__all__)
