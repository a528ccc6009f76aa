from tpu_helpers.teaching.plots import plot_history


def test_plot_history_draws_train_and_validation_curves():
    fig = plot_history(
        {"loss": [0.7, 0.5, 0.4], "val_loss": [0.6, 0.55, 0.5], "accuracy": [0.6, 0.7, 0.8]}, "t"
    )
    loss_ax, acc_ax = fig.axes
    assert [line.get_label() for line in loss_ax.lines] == ["loss", "val_loss"]
    assert list(loss_ax.lines[1].get_ydata()) == [0.6, 0.55, 0.5]
    assert list(loss_ax.lines[0].get_xdata()) == [1, 2, 3]
    assert [line.get_label() for line in acc_ax.lines] == ["accuracy"]


def test_titles_name_checkpoints_and_data_not_the_folders_of_a_machine():
    from tpu_helpers.teaching.plots import short_name

    assert short_name("/home/someone/build/fixtures/tiny-vit") == "tiny-vit"
    assert short_name("gs://bucket/data/beans/") == "beans"
    assert short_name("./outputs/model") == "model"
    assert short_name("google/vit-base-patch16-224") == "google/vit-base-patch16-224"
    assert short_name("glue") == "glue"
