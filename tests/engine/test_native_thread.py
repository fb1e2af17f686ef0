"""Threads the engine starts carry their names down to the OS (what top -H and /proc show)."""

import sys
import threading

import pytest

from lora_runtime.native_thread import name_native_thread

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and prctl are Linux's")


def _comm(native_id: int) -> str:
    with open(f"/proc/self/task/{native_id}/comm") as f:
        return f.read().strip()


@linux
def test_a_thread_takes_its_python_name_cut_to_fifteen_bytes():
    seen = {}

    def run():
        seen["set"] = name_native_thread()
        seen["comm"] = _comm(threading.get_native_id())

    t = threading.Thread(target=run, name="adapter-fetch_12345")
    t.start()
    t.join()
    assert seen == {"set": True, "comm": "adapter-fetch_1"}


@linux
def test_an_explicit_name_wins_and_other_threads_keep_theirs():
    main_before = _comm(threading.get_native_id())
    seen = {}

    def run():
        name_native_thread("engine-loop")
        seen["comm"] = _comm(threading.get_native_id())

    t = threading.Thread(target=run, name="something-else")
    t.start()
    t.join()
    assert seen["comm"] == "engine-loop"
    assert _comm(threading.get_native_id()) == main_before
