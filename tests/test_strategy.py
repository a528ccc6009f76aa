import pytest
from conftest import run_python

from tpu_helpers.runtime import RuntimeFacts
from tpu_helpers.tf_engine.strategy import connect, tpu_candidates


def test_tpu_candidates_order_and_sources():
    tpu = RuntimeFacts(platform="tpu-vm", accelerator="tpu")
    assert tpu_candidates(None, tpu, {}) == ["local"]
    assert tpu_candidates(None, RuntimeFacts(), {}) == []
    env = {"TPU_NAME": "pod-a", "COLAB_TPU_ADDR": "10.1.2.3:8470"}
    assert tpu_candidates("explicit", tpu, env) == ["explicit", "pod-a", "grpc://10.1.2.3:8470"]
    assert tpu_candidates("pod-a", tpu, env) == ["pod-a", "grpc://10.1.2.3:8470"]


@pytest.mark.parametrize("bad", [-1, 2.0, "8"])
def test_bad_replica_count_is_refused_with_the_value(bad):
    with pytest.raises(ValueError, match=f"simulated_replicas={bad!r}"):
        connect(simulated_replicas=bad, verbose=False)


@pytest.fixture(scope="module")
def simulated():
    """One process split into 2 simulated replicas: it computes on them, connects again
    (the same split is fine, another is refused), then trains with Keras' steps_per_execution
    loop on batches of two widths (an embedding's sparse gradient changes shape with the
    width) and prints the largest gap between the two replicas' copies of a variable."""
    result = run_python(
        """
        import tpu_helpers
        import numpy as np
        import tensorflow as tf
        from tpu_helpers.tf_engine.strategy import replica_sum
        s = tpu_helpers.connect(simulated_replicas=2)
        print("REPLICAS", s.num_replicas_in_sync, replica_sum(s))
        again = tpu_helpers.connect(simulated_replicas=2)        # same split: fine
        print("AGAIN", again.num_replicas_in_sync)
        try:
            tpu_helpers.connect(simulated_replicas=4)            # devices already set up
        except RuntimeError as err:
            print("REFUSED", err)

        def dataset_fn(context):
            ids = [np.full((4, [8, 24][step % 2]), step % 50 + 1, np.int32) for step in range(32)]
            ds = tf.data.Dataset.from_generator(
                lambda: ((x, x[:, 0] % 2) for x in ids for _ in range(2)),  # one per replica
                output_signature=(tf.TensorSpec([4, None], tf.int32), tf.TensorSpec([4], tf.int32)),
            )
            return ds

        with s.scope():
            model = tf.keras.Sequential([
                tf.keras.layers.Embedding(64, 8),
                tf.keras.layers.GlobalAveragePooling1D(),
                tf.keras.layers.Dense(2),
            ])
            model.compile(
                tf.keras.optimizers.Adam(1e-2),
                tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                steps_per_execution=8,
            )
        model.fit(s.distribute_datasets_from_function(dataset_fn), epochs=1, steps_per_epoch=32, verbose=0)
        gap = max(float(tf.reduce_max(tf.abs(v.values[0] - v.values[1]))) for v in model.weights)
        print("TRAINED", gap)
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_simulated_replicas_run_compute_and_reconnect(simulated):
    assert "REPLICAS 2 3.0" in simulated
    assert "CPU (2 simulated replicas) | replicas 2" in simulated
    assert "AGAIN 2" in simulated
    assert "REFUSED" in simulated and "simulated_replicas=4" in simulated
    assert "restart the runtime" in simulated


def test_simulated_replicas_train_many_steps_per_call_on_batches_of_several_widths(simulated):
    """It trains, and the two replicas' copies of every variable stay equal."""
    assert "TRAINED 0.0" in simulated


def test_import_sets_the_legacy_keras_flag_before_tensorflow_and_connects_to_the_default():
    result = run_python(
        """
        import os
        os.environ.pop("TF_USE_LEGACY_KERAS", None)
        import tpu_helpers
        import tensorflow as tf
        print("FLAG", os.environ["TF_USE_LEGACY_KERAS"], tf.keras.Model.__module__.split(".")[0])
        from tpu_helpers.tf_engine.strategy import replica_sum
        s = tpu_helpers.connect()
        print("SUM", s.num_replicas_in_sync, replica_sum(s))
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0] == "FLAG 1 tf_keras", lines
    assert lines[1].startswith("CPU | replicas 1 | local | TF "), lines  # connect's own line
    assert lines[2] == "SUM 1 1.0", lines


def test_unresolvable_tpu_names_what_was_tried():
    result = run_python(
        """
        import tpu_helpers
        from tpu_helpers.tf_engine.strategy import TPUConnectionError
        try:
            tpu_helpers.connect(tpu="local")
        except TPUConnectionError as err:
            print("ERR", err)
        """,
        env={"COLAB_TPU_ADDR": "127.0.0.1:1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "ERR Could not connect to a TPU. Tried:" in out
    assert "'local':" in out and "'grpc://127.0.0.1:1':" in out
    assert "Fix:" in out


def test_a_tpu_tensorflow_cannot_drive_sends_the_learner_to_the_main_track():
    """Colab's v5e with tensorflow-tpu 2.20: TensorFlow finds no kernel for the TPU's ops."""
    from tpu_helpers.tf_engine.strategy import connection_failed

    colab = (
        "  'local': NotFoundError: No OpKernel was registered to support Op"
        " 'ConfigureDistributedTPU' used by {{node ConfigureDistributedTPU}} with these attrs:"
        " [...] Registered devices: [CPU]"
    )
    message = connection_failed([colab])
    assert colab in message
    assert "cannot drive this TPU" in message
    assert "notebooks/00_setup_and_connect.ipynb" in message and "Keras 3" in message
    assert "pass tpu='local'" not in message  # already done: no loop back to it
    other = connection_failed(["  'my-tpu': NotFoundError: TPU my-tpu not found"])
    assert "pass tpu='local'" in other and "notebooks/00_setup_and_connect.ipynb" in other


def test_an_address_that_never_answers_fails_within_the_deadline():
    import socket
    import threading
    import time

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]
    held = []

    def accept_and_say_nothing():
        while True:
            try:
                held.append(server.accept()[0])  # keep the connection open, silent
            except OSError:
                return

    threading.Thread(target=accept_and_say_nothing, daemon=True).start()
    try:
        start = time.monotonic()
        result = run_python(
            f"""
            import tpu_helpers
            from tpu_helpers.tf_engine.strategy import TPUConnectionError
            try:
                tpu_helpers.connect(tpu="grpc://127.0.0.1:{port}", timeout=5)
            except TPUConnectionError as err:
                print("ERR", err)
            """,
            timeout=120,
        )
        took = time.monotonic() - start
    finally:
        server.close()
        for conn in held:
            conn.close()
    assert result.returncode == 0, result.stderr[-3000:]
    assert "did not finish within 5 s" in result.stdout, result.stdout
    assert f"grpc://127.0.0.1:{port}" in result.stdout and "timeout=" in result.stdout
    assert took < 60
