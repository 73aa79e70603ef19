"""The document store kept on disk (``serve --doc-store-dir``) loses nothing to a crash: a real
server process SIGKILLed while it writes document sets leaves every file either the old complete
one or the new complete one (never torn), and the restarted server answers from them. A truncated
or corrupt file, one made by another model, one holding another method's set than its name says,
and a full disk each give an error naming the file, while the store serves every other set."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_testing import running_server
from snapkv_testing import filler_documents, tiny_llama
from test_serve_process import serve

from snapkv_rag import KeyNormConfig, KVzipConfig, SnapKVLLM
from snapkv_rag.documents import files
from snapkv_rag.documents.folder import SUFFIX

pytestmark = pytest.mark.usefixtures("one_thread")
WHOLE = {"method": "keynorm", "budget": "100%"}  # everything kept: the files are as large as they get
HALF = {"method": "keynorm", "budget": "50%", "window_size": 8}  # = HALF_CONFIG
HALF_CONFIG = KeyNormConfig(ratio=0.5, window_size=8)
QUESTION = "Which river lies north?"

# Loaded first in the server process (PYTHONPATH): a slow disk, so that a write is long enough to be
# caught in the middle. The first write to a temporary ".partial" file writes half its bytes and
# waits; the rest follows as usual; nothing else changes.
SLOW_DISK = """
import os, time
_write = os.write
def _slow(fd, data):
    try:
        slow = os.readlink(f"/proc/self/fd/{fd}").endswith(".partial") and os.lseek(fd, 0, os.SEEK_CUR) == 0
    except OSError:
        slow = False
    if not slow or len(data) < 2:
        return _write(fd, data)
    half = _write(fd, bytes(data[: len(data) // 2]))
    time.sleep(0.3)
    return half
os.write = _slow
"""


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("tiny-model")
    tiny_llama(len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def sets(count: int, start: int = 0) -> list[list[dict]]:
    """``count`` distinct document sets of 3 to 5 long documents."""
    return [
        filler_documents(3 + (start + i) % 3, words=240)[::-1] + [{"text": f"set {start + i}"}] for i in range(count)
    ]


def ask(url: str, model: str, documents: list[dict], method: dict = HALF) -> httpx.Response:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": QUESTION}],
        "documents": documents,
        "max_tokens": 4,
        "snapkv": method,
    }
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


def answer(reply: httpx.Response) -> str:
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["content"]


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.glob(f"*{SUFFIX}")}


def metric(url: str, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", httpx.get(url + "/metrics").text, re.M).group(1))


@pytest.mark.heavy  # two server processes start: most of a minute on 2 cores
def test_sigkill_while_writing_leaves_whole_files_and_the_restart_answers_from_them(model_folder, tmp_path):
    store, slow = tmp_path / "store", tmp_path / "slow-disk"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(SLOW_DISK)
    env = {"PYTHONPATH": os.pathsep.join([str(slow), os.environ.get("PYTHONPATH", "")])}
    log = (tmp_path / "first.log").open("w")
    process, url = serve(model_folder, "--doc-store-dir", str(store), output=log, env=env)
    model = str(model_folder)
    try:
        before = [answer(ask(url, model, docs, WHOLE)) for docs in sets(2)]  # written in full
        whole = digests(store)
        assert len(whole) == 2
        more = sets(6, start=2)
        threads = [threading.Thread(target=lambda d=d: _quietly(ask, url, model, d, WHOLE)) for d in more]
        for thread in threads:
            thread.start()
        deadline, caught = time.monotonic() + 60, None
        while caught is None and time.monotonic() < deadline:
            caught = next((p for p in store.iterdir() if p.name.endswith(".partial") and p.stat().st_size), None)
            time.sleep(0.005)
        process.send_signal(signal.SIGKILL)
        process.wait(30)
    finally:
        process.kill()
        log.close()
    for thread in threads:
        thread.join(60)
    assert caught is not None, "no write was caught in the middle"
    partial = [p for p in store.iterdir() if p.name.endswith(".partial")]
    assert partial, "the write cut short left its temporary file"
    after = digests(store)
    assert {name: after[name] for name in whole} == whole  # the old files: untouched, byte for byte
    checker = SnapKVLLM(model=model, max_new_tokens=4)
    for path in store.glob(f"*{SUFFIX}"):  # every file there is complete and loads
        assert files.load(checker, path).key == path.stem
    checker.close()

    log = (tmp_path / "second.log").open("w")
    process, url = serve(model_folder, "--doc-store-dir", str(store), output=log)
    try:
        assert [answer(ask(url, model, docs, WHOLE)) for docs in sets(2)] == before  # from the files
        assert metric(url, "snapkv_rag_doc_store_misses") == 0
        answer(ask(url, model, more[0], WHOLE))  # any set: answered, from its file or compressed again
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)
        log.close()
    assert not [p for p in store.iterdir() if p.name.endswith(".partial")]  # the restart removed it
    text = (tmp_path / "second.log").read_text()
    assert "a write cut short by a crash" in text and partial[0].name in text and "Traceback" not in text


def _quietly(function, *args) -> None:
    try:
        function(*args)
    except httpx.HTTPError:  # the server was killed under it
        pass


@pytest.fixture()
def stored(tokenizer, tiny_model, tmp_path):
    """A store folder holding four sets written by an engine of ``tiny_model``; their documents."""
    folder = tmp_path / "store"
    llm = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, max_new_tokens=4, doc_store_dir=folder)
    documents = sets(4)
    handles = [llm.index_documents(docs, method=HALF_CONFIG) for docs in documents]
    return folder, documents, [h.key for h in handles]


def test_bad_files_are_named_and_the_store_serves_the_rest(stored, tiny_model, tokenizer, tmp_path, caplog):
    folder, documents, keys = stored
    paths = [folder / f"{key}{SUFFIX}" for key in keys]
    data = paths[0].read_bytes()
    paths[0].write_bytes(data[: len(data) // 2])  # truncated
    flipped = bytearray(paths[1].read_bytes())
    flipped[-100] ^= 0xFF
    paths[1].write_bytes(bytes(flipped))  # corrupt: its tensors do not hash to the checksum
    other = SnapKVLLM(model=tiny_llama(len(tokenizer), seed=1), tokenizer=tokenizer, doc_store_dir=tmp_path / "o")
    foreign = other.index_documents(documents[2], method=HALF_CONFIG)
    os.replace(tmp_path / "o" / f"{foreign.key}{SUFFIX}", paths[2])  # made by another model
    kvzip = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, doc_store_dir=tmp_path / "k")
    renamed = kvzip.index_documents(documents[3], method=KVzipConfig(ratio=0.5, window_size=8))
    os.replace(tmp_path / "k" / f"{renamed.key}{SUFFIX}", paths[3])  # another method's set under this name
    good = sets(1, start=4)[0]
    SnapKVLLM(model=tiny_model, tokenizer=tokenizer, doc_store_dir=folder).index_documents(good, method=HALF_CONFIG)

    with caplog.at_level(logging.ERROR, logger="snapkv_rag.documents"):
        llm = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, max_new_tokens=4, doc_store_dir=folder)
    opened = caplog.text
    for path, words in (
        (paths[0], "corrupt or truncated"),
        (paths[2], "another model configuration"),
        (paths[3], "another document set than its name says (method kvzip"),
    ):
        assert f"{path} " in opened or f"{path}:" in opened, (path, opened)
        assert words in opened
    assert str(paths[1]) not in opened  # its header is fine: its tensors are checked when it is read

    caplog.clear()
    with running_server(llm, max_documents=8) as (url, _), caplog.at_level(logging.ERROR, "snapkv_rag.documents"):
        ask_all = [answer(ask(url, "tiny", docs)) for docs in [good, *documents]]
        assert metric(url, "snapkv_rag_doc_store_misses") == 4  # the good set from its file, the four bad rebuilt
        assert f"{paths[1]} is corrupt: its tensors do not match the checksum" in caplog.text
        fresh = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, max_new_tokens=4)
        assert ask_all == [
            fresh.index_documents(docs, method=HALF_CONFIG).generate(QUESTION).text for docs in [good, *documents]
        ]
    for path, key in zip(paths, keys):  # each bad file replaced by a good one
        assert files.load(llm, path).key == key


def test_a_full_disk_names_the_file_keeps_the_old_one_and_the_store_serves_on(stored, tiny_model, tokenizer, caplog):
    folder, documents, keys = stored
    before = digests(folder)
    write = os.write

    def full(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".partial"):
            write(fd, bytes(data[:100]))
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(fd, data)

    llm = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, max_new_tokens=4, doc_store_dir=folder)
    new = sets(1, start=9)[0]
    with pytest.MonkeyPatch.context() as patch, caplog.at_level(logging.ERROR, logger="snapkv_rag.documents"):
        patch.setattr(os, "write", full)
        with running_server(llm, max_documents=8) as (url, _):
            answers = [answer(ask(url, "tiny", docs)) for docs in [new, documents[0], new]]
            assert metric(url, "snapkv_rag_doc_store_misses") == 1  # compressed once, kept in memory
    target = folder / f"{llm.index_documents(new, method=HALF_CONFIG).key}{SUFFIX}"
    assert f"could not write {target}: No space left on device; the set is kept in memory only" in caplog.text
    assert digests(folder) == before and not [p for p in folder.iterdir() if p.name.endswith(".partial")]
    assert answers[0] == answers[2]
    llm.doc_store.folder.save(llm, llm.doc_store.get(target.stem))  # space again: written
    assert files.load(llm, target).key == target.stem


def test_the_folder_keeps_within_its_bound_on_disk(tiny_model, tokenizer, tmp_path, caplog):
    """Beyond ``doc_store_disk_bytes`` the least recently used files go; a set larger than the whole
    bound is not written, and the log names the option that raises it."""
    probe = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, doc_store_dir=tmp_path / "probe")
    size = (tmp_path / "probe" / f"{probe.index_documents(sets(1)[0], method=HALF_CONFIG).key}{SUFFIX}").stat().st_size
    folder = tmp_path / "store"
    llm = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, doc_store_dir=folder, doc_store_disk_bytes=int(size * 2.5))
    keys = []
    for i, docs in enumerate(sets(3, start=20)):
        keys.append(llm.index_documents(docs, method=HALF_CONFIG).key)
        os.utime(folder / f"{keys[-1]}{SUFFIX}", (1000 + i, 1000 + i))  # written one after another
    assert sorted(p.stem for p in folder.glob(f"*{SUFFIX}")) == sorted(keys[1:])  # the oldest went
    small = SnapKVLLM(model=tiny_model, tokenizer=tokenizer, doc_store_dir=tmp_path / "small", doc_store_disk_bytes=10)
    with caplog.at_level(logging.WARNING, logger="snapkv_rag.documents"):
        handle = small.index_documents(sets(1)[0], method=HALF_CONFIG)
    assert "over the folder's bound of 10 bytes (--doc-store-disk-bytes raises it)" in caplog.text
    assert not list((tmp_path / "small").glob(f"*{SUFFIX}")) and handle.generate(QUESTION).text is not None
