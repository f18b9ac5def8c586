"""Every code block of the README runs as written (or says, in the README, why it cannot here).

Python blocks tagged `<!-- readme: NAME -->` are executed by a test of that name below (top-level
`await` allowed, as in a notebook); a block tagged `<!-- readme: skip REASON -->` is only compiled.
TOML blocks must parse, bash blocks must pass `bash -n`. An untagged Python block fails the suite,
so a new snippet cannot go stale unnoticed.
"""

from __future__ import annotations

import ast
import asyncio
import re
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>\w*)\s*$")
_TAG = re.compile(r"<!--\s*readme:\s*(?P<tag>[\w-]+)(?P<reason>[^>]*)-->")


@dataclass(frozen=True)
class Block:
    lang: str
    code: str
    line: int  # of the opening fence, 1-based
    tag: str | None  # from a `<!-- readme: ... -->` comment on the line before the fence


def readme_blocks() -> list[Block]:
    lines = README.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, indent, body = i, len(m["indent"]), []
        i += 1
        while not _FENCE.match(lines[i]):
            body.append(lines[i][indent:])
            i += 1
        tag = _TAG.search(lines[start - 1]) if start else None
        blocks.append(Block(m["lang"], "\n".join(body) + "\n", start + 1, tag["tag"] if tag else None))
        i += 1
    return blocks


def python_block(tag: str) -> Block:
    (block,) = [b for b in readme_blocks() if b.lang == "python" and b.tag == tag]
    return block


def run_block(block: Block, namespace: dict) -> dict:
    code = compile(block.code, f"README.md:{block.line}", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    result = eval(code, namespace)  # a coroutine when the block awaits
    if asyncio.iscoroutine(result):
        asyncio.run(result)
    return namespace


def test_every_python_block_is_run_by_a_test_or_says_why_not():
    names = {name.removeprefix("test_block_") for name in globals() if name.startswith("test_block_")}
    for block in readme_blocks():
        if block.lang != "python":
            continue
        assert block.tag, f"README.md:{block.line}: tag the block `<!-- readme: NAME -->` and run it here"
        assert block.tag == "skip" or block.tag.replace("-", "_") in names, f"README.md:{block.line}: no test"
        compile(block.code, f"README.md:{block.line}", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


def test_toml_and_bash_blocks_parse():
    blocks = readme_blocks()
    assert any(b.lang == "toml" for b in blocks) and any(b.lang == "bash" for b in blocks)
    for block in blocks:
        if block.lang == "toml":
            tomllib.loads(block.code)
        elif block.lang == "bash":
            r = subprocess.run(["bash", "-n"], input=block.code, capture_output=True, text=True)
            assert r.returncode == 0, f"README.md:{block.line}: {r.stderr}"


@pytest.mark.slow
def test_block_python_api(tmp_path, model_cache, monkeypatch):
    # As written, from the repository root: the sample corpus is `examples/…`, the data
    # directory `my-index` (here in a temporary directory that links the examples in).
    (tmp_path / "examples").symlink_to(REPO / "examples", target_is_directory=True)
    (tmp_path / "my-index").mkdir(mode=0o700)
    (tmp_path / "my-index" / "models").symlink_to(model_cache, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    # The block's last line reranks every candidate of 64 questions: 10 candidates instead of 20
    # halve that and change nothing the block shows.
    monkeypatch.setenv("RAG_CANDIDATES", "10")
    ns = run_block(python_block("python-api"), {})
    assert ns["answer"].citations and ns["hits"]
    assert not any("imaging" not in c.source and "public" not in c.source for c in ns["answer"].citations)
    ns["rag"].close()


@pytest.mark.slow
def test_block_openai_client(lab_rag):
    from rag.api.app import create_app
    from tests.rag.live_server import serving

    block = python_block("openai-client")
    with serving(create_app(lab_rag.settings)) as url:
        code = block.code.replace("http://127.0.0.1:8000", url)
        assert code != block.code  # the block names the default address: this test points it here
        ns = run_block(Block(block.lang, code, block.line, block.tag), {"KEY": lab_rag.identity.create_key("bob")})
    assert ns["r"].choices[0].message.content
