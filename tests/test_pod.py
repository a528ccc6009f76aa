"""A pod slice with two hosts, simulated on loopback: every input path on several hosts.

Two processes, each a ``MultiWorkerMirroredStrategy`` worker (``tests/pod_worker.py``),
form the cluster; each runs its own input pipeline, as each host of a TPU slice does.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from tpu_helpers.data import records

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "pod_worker.py"
TIMEOUT = 240  # seconds for one launch of both hosts; a hang fails the test

pytestmark = pytest.mark.pod_slice


def _free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _launch(data_dir: Path, tag: str, *args: str) -> list[tuple[int, dict | None, str]]:
    """Start both hosts, wait for both (or fail on a hang): ``(rc, result, log)`` each."""
    hosts = [f"localhost:{p}" for p in _free_ports(2)]
    procs, outs = [], []
    for task in range(2):
        config = {"cluster": {"worker": hosts}, "task": {"type": "worker", "index": task}}
        out = data_dir / f"{tag}-{task}.json"
        env = dict(os.environ, TF_CONFIG=json.dumps(config), TF_CPP_MIN_LOG_LEVEL="2")
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), str(data_dir), str(out), *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=ROOT,
                env=env,
            )
        )
        outs.append(out)
    results = []
    try:
        for proc, out in zip(procs, outs, strict=True):
            log = proc.communicate(timeout=TIMEOUT)[0]
            results.append(
                (proc.returncode, json.loads(out.read_text()) if out.exists() else None, log)
            )
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        pytest.fail(f"the two hosts did not finish within {TIMEOUT} s ({tag}): a host hangs")
    return results


def _data(data_dir: Path) -> dict:
    """300 examples of 3-40 tokens (first token = id + 1), in memory and as shards."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 41, 300)
    ids = [[i + 1] + rng.integers(1, 1000, n - 1).tolist() for i, n in enumerate(lengths)]
    labels = [int(x[-1] % 2) for x in ids]
    split = {"input_ids": ids, "length": lengths.tolist(), "label": labels}
    (data_dir / "split.json").write_text(json.dumps(split))
    rows = [{"input_ids": x, "label": y} for x, y in zip(ids, labels, strict=True)]
    records.write_records(rows, str(data_dir / "bucketed"), shard_records=20, progress=False)
    padded = [
        {
            "input_ids": x + [0] * (40 - len(x)),
            "attention_mask": [1] * len(x) + [0] * (40 - len(x)),
            "label": y,
        }
        for x, y in zip(ids, labels, strict=True)
    ]
    records.write_records(padded, str(data_dir / "fixed"), shard_records=40, progress=False)
    ids_of = {}
    for kind in ("bucketed", "fixed"):
        for path in tf.io.gfile.glob(str(data_dir / kind / "*.tfrecord")):
            for raw in tf.data.TFRecordDataset(path):
                example = tf.train.Example.FromString(raw.numpy())
                ids_of.setdefault(path, []).append(
                    example.features.feature["input_ids"].int64_list.value[0] - 1
                )
    return {"n": len(ids), "shard_ids": ids_of}


@pytest.fixture(scope="module")
def pod(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("pod")
    data = _data(data_dir)
    whole = _launch(data_dir, "whole")
    for rc, _, log in whole:
        assert rc == 0, log[-4000:]
    return data_dir, data, [r for _, r, _ in whole]


@pytest.mark.parametrize("source", ["in_memory", "bucketed", "fixed"])
def test_every_host_and_replica_agree_and_every_example_is_used_once(pod, source):
    _, data, hosts = pod
    assert [h["replicas"] for h in hosts] == [2, 2]
    a, b = hosts[0][source], hosts[1][source]
    steps = a["steps_per_epoch"]  # batches.steps_on(strategy)
    assert steps == b["steps_per_epoch"] and steps > 0
    assert a["one_host_steps"] == b["one_host_steps"]  # batches.steps_per_epoch
    if source == "in_memory":  # every host cuts its replicas' rows from the same plan
        assert steps == a["one_host_steps"]
    else:  # each host reads its own shards: it may need filler steps, never fewer
        assert steps >= a["one_host_steps"]
    for epoch in range(2):
        one, two = a["epochs"][epoch], b["epochs"][epoch]
        # every host ran the same number of steps, which is the steps per epoch
        assert len(one) == len(two) == steps
        used = []
        for step_one, step_two in zip(one, two, strict=True):
            # one replica per host here: each step, both replicas had the same width
            (w1, ids1, wt1), (w2, ids2, wt2) = step_one[0], step_two[0]
            assert w1 == w2, (epoch, step_one, step_two)
            used += [i for i, w in zip(ids1 + ids2, wt1 + wt2, strict=True) if w == 1]
            assert set(wt1 + wt2) <= {0.0, 1.0}
        # over an epoch every example was used exactly once with weight 1
        assert sorted(used) == list(range(data["n"])), (source, epoch)
    # epochs are shuffled differently
    assert [s[0][1] for s in a["epochs"][0]] != [s[0][1] for s in a["epochs"][1]]
    # resuming epoch 2 at step 2 gives the steps the uninterrupted epoch ran from there
    assert a["resumed_epoch"] == a["epochs"][1][2:]
    assert b["resumed_epoch"] == b["epochs"][1][2:]
    # training kept the weights identical on both hosts
    assert a["training"]["weights"] == b["training"]["weights"]
    assert a["training"]["final_step"] == b["training"]["final_step"] == 2 * steps


@pytest.mark.parametrize("source", ["bucketed", "fixed"])
def test_hosts_read_disjoint_shards_that_cover_them_all(pod, source):
    data_dir, data, hosts = pod
    shards = {p for p in data["shard_ids"] if f"/{source}/" in p}
    files = [set(h[source]["files"]) for h in hosts]
    assert files[0] and files[1] and not files[0] & files[1]
    assert files[0] | files[1] == shards
    for host, mine in zip(hosts, files, strict=True):
        readable = {i for p in mine for i in data["shard_ids"][p]}
        seen = {
            i
            for epoch in host[source]["epochs"]
            for step in epoch
            for i, w in zip(step[0][1], step[0][2], strict=True)
            if w == 1
        }
        assert seen == readable  # each host read exactly its own shards


def test_a_killed_slice_resumes_at_the_same_step_on_every_host(pod):
    data_dir, _, hosts = pod
    killed = _launch(data_dir, "killed", "--kill-at", "3")
    assert [rc for rc, _, _ in killed] == [3, 3], killed[0][2][-3000:]
    resumed = _launch(data_dir, "resumed", "--resume")
    for rc, _, log in resumed:
        assert rc == 0, log[-4000:]
    runs = [r["bucketed"]["training"] for _, r, _ in resumed]
    assert [r["resumed_at"] for r in runs] == [3, 3]
    whole = hosts[0]["bucketed"]["training"]
    for run in runs:
        assert run["final_step"] == whole["final_step"]
        np.testing.assert_allclose(run["weights"], whole["weights"], rtol=1e-5)
