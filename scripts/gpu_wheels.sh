#!/usr/bin/env bash
# What the GPU machine lacks for the benchmarks, made here (after scripts/setup.sh) into ignored
# folders that a device call carries (its `carry` list, 64 MiB in all with the tree):
#
#   bench/wheels/           the web stack (fastapi, uvicorn, pydantic, ...), 5.7 MB: rag serve, rag ingest's CLI
#   bench/wheels-faiss/     faiss-cpu, 18.8 MB: bench/filtered_search.py
#   bench/wheels-parse/     psite.tar.xz, 27 MB: unstructured, spaCy and their compiled dependencies
#                           for Python 3.12, unpacked and stripped (their wheels are 77 MB), with the
#                           en_core_web_sm stub and langdetect (no wheel) from .venv
#   .gpu-carry/minilm       the packaged MiniLM in float16, 45 MB (scripts/gpu_carry.sh)
#
# On the machine: `python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site
# bench/wheels/*.whl`, `tar xJf bench/wheels-parse/psite.tar.xz -C /tmp` (then
# PYTHONPATH=/tmp/psite:/tmp/site:.), and faiss likewise into its own --target. docs/benchmarks.md
# names the calls that used each. Idempotent: a folder that exists is kept.
set -euo pipefail
cd "$(dirname "$0")/.."

PLATFORMS=(--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_5_x86_64
           --platform manylinux1_x86_64)
download() {  # download DIR SPEC...: cp312 binary wheels, no dependencies (each one is named)
    local dir=$1
    shift
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${PLATFORMS[@]}" -d "$dir" "$@" 2>&1 | grep -v "^WARNING: Location" || true
}

if [ ! -d bench/wheels ]; then
    download bench/wheels fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 h11 pydantic==2.14.4 \
        pydantic_core==2.50.5 pydantic-settings python-dotenv typing-inspection annotated-types annotated-doc \
        anyio sniffio httpx httpcore idna typing_extensions opentelemetry-api typer==0.29.2 rich \
        markdown-it-py mdurl pygments shellingham click prometheus-client certifi
fi

if [ ! -d bench/wheels-faiss ]; then
    download bench/wheels-faiss faiss-cpu==1.15.1
fi

if [ ! -f bench/wheels-parse/psite.tar.xz ]; then
    # The versions .venv holds: the parse stack that the tests run.
    versions=$(.venv/bin/python -m pip list --format=freeze 2>/dev/null)
    pin() { echo "$versions" | grep -i "^$1==" | head -1; }
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    specs=()
    for name in beautifulsoup4 blis catalogue cffi confection cryptography cymem emoji filetype html5lib \
                httpx2 murmurhash nh3 olefile pdf2image pi_heif pikepdf preshed pycparser pypdf python-docx \
                python-iso639 python-magic rapidfuzz soupsieve spacy srsly thinc unstructured \
                unstructured_inference wasabi weasel webencodings pdfminer.six; do
        spec=$(pin "$name")
        [ -n "$spec" ] || { echo "error: $name is not in .venv; run scripts/setup.sh first" >&2; exit 1; }
        specs+=("$spec")
    done
    download "$work/wheels" "${specs[@]}"
    mkdir -p "$work/psite"
    for w in "$work"/wheels/*.whl; do unzip -q -o "$w" -d "$work/psite"; done
    site=$(.venv/bin/python -c "import site; print(site.getsitepackages()[0])")
    # Pure Python, from .venv: langdetect has no wheel; en_core_web_sm is our stub
    # (scripts/build_spacy_stub.sh), and unstructured finds it by its dist-info.
    cp -r "$site"/langdetect "$site"/en_core_web_sm "$site"/en_core_web_sm-*.dist-info "$work/psite/"
    find "$work/psite" -name "*.so*" -type f -exec strip --strip-unneeded {} +
    rm -rf "$work/psite/spacy/tests"
    find "$work/psite" -name __pycache__ -type d -prune -exec rm -rf {} +
    mkdir -p bench/wheels-parse
    tar cJf bench/wheels-parse/psite.tar.xz -C "$work" psite
fi
du -sh bench/wheels bench/wheels-faiss bench/wheels-parse
