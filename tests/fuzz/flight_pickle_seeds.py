"""Writes the seeds of the fuzz target flight_pickle (corpus/flight_pickle/): a record in the shape
src/comm/flight_recorder.cpp writes, and hostile ones that share values through the pickle's memo
(budget_*: past the reader's budget, or within it at 8 values per byte) or hold themselves (cycle_*).

    python3 tests/fuzz/flight_pickle_seeds.py tests/fuzz/corpus/flight_pickle
"""
import os
import pickle
import sys


def seeds():
    # l = []; l += [l, l]: a cycle that, followed down to a depth limit, doubles at every level.
    yield "cycle_twice", b"\x80\x02]q\x00(h\x00h\x00e."
    # Each level a pair of the one below and a reference to it: 2^40 values in 206 bytes.
    p = b"\x80\x02]q\x00"
    for k in range(1, 41):
        p += bytes([ord("h"), k - 1, 0x86, ord("q"), k])
    yield "budget_doubling", p + b"."
    yield "budget_shared_list", pickle.dumps([list(range(16))] * 2000, 2)
    yield "budget_shared_text", pickle.dumps({"entries": ["k" * 1000] * 500}, 2)
    yield "record", pickle.dumps({
        "version": "2.10", "rank": 1, "pg_config": {"default": {"desc": "default_pg", "ranks": "[0, 1]"}},
        "entries": [{"collective_seq_id": 3, "profiling_name": "gloo:all_reduce", "input_sizes": [[4, 2]],
                     "input_dtypes": ["Float"], "state": "started", "time_created_ns": 2**40,
                     "process_group": ["default", ""], "is_p2p": False, "duration_ms": None, "frames": []}]}, 2)


if __name__ == "__main__":
    os.makedirs(sys.argv[1], exist_ok=True)
    for name, data in seeds():
        with open(os.path.join(sys.argv[1], name), "wb") as f:
            f.write(data)
