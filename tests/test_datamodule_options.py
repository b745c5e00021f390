"""RoIDataModule's grouped options: flat names refused naming their nested key, the
options that resolve from the Detectron config, the options that reach the roidb build, the loader
and the augmentation, DemoRoIDataModule, and ``fit --help``."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from lit_roidata import DemoRoIDataModule, RoIDataModule
from lit_roidata.cli import main
from lit_roidata.options import GROUPS, MOVED_OPTIONS, LoaderOptions, SourceOptions

from roidb_fixtures import make_coco, write_dataset
from datamodule_support import REPO, dm_kwargs, shared_root


@pytest.fixture(scope="module")
def root(tmp_path_factory: Any) -> Path:
    return shared_root(tmp_path_factory)


# ------------------------------------------------------------------------- flat names
@pytest.mark.parametrize("flat", sorted(MOVED_OPTIONS))
def test_every_flat_name_is_refused_naming_its_nested_key(flat: str) -> None:
    group, key = MOVED_OPTIONS[flat]
    assert key in {f.name for f in dataclasses.fields(GROUPS[group])}
    with pytest.raises(TypeError, match=rf"{flat}=\.\.\. is now {group}\.{key}"):
        RoIDataModule(**{flat: None})


def test_unknown_names_are_errors_that_list_the_valid_ones() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'num_worker'.*loader"):
        RoIDataModule(num_worker=1)
    with pytest.raises(TypeError, match=r"loader: unknown option\(s\) \['workers'\]"):
        RoIDataModule(loader={"workers": 1})
    with pytest.raises(TypeError, match="expected a SourceOptions"):
        RoIDataModule(sources=3)  # type: ignore[arg-type]


def test_groups_take_dataclasses_or_dicts_and_hparams_stay_plain(tmp_path: Path) -> None:
    a = RoIDataModule(sources=SourceOptions(cache_dir="/c"), loader={"num_workers": 0})
    b = RoIDataModule(sources={"cache_dir": "/c"}, loader=LoaderOptions(num_workers=0))
    assert (a.sources, a.loader) == (b.sources, b.loader)
    assert a.hparams["loader"]["num_workers"] == 0
    # A checkpoint stores the hyperparameters; a weights_only read must accept them.
    torch.save({"hp": dict(a.hparams)}, tmp_path / "hp.pt")
    back = torch.load(tmp_path / "hp.pt", weights_only=True)["hp"]
    assert back["sources"]["cache_dir"] == "/c" and back["augment"] is None
    again = RoIDataModule(**back)  # what load_from_checkpoint does with them
    assert (again.sources, again.loader) == (a.sources, a.loader)
    demo = DemoRoIDataModule(demo_root="d", demo_size={"demo_val": 2}, loader={"num_workers": 0})
    same = DemoRoIDataModule(**dict(demo.hparams))
    assert (same.demo_root, same.demo_size, same.loader) == ("d", {"demo_val": 2}, demo.loader)


# ------------------------------------------------------- None: from the Detectron config
def test_none_takes_the_detectron_key_and_a_value_is_written_into_cfg() -> None:
    dm = RoIDataModule(overrides={"TRAIN.IMS_PER_BATCH": 3, "TRAIN.ASPECT_GROUPING": False})
    assert dm.cfg.TRAIN.IMS_PER_BATCH == 3 and dm.cfg.TRAIN.ASPECT_GROUPING is False
    dm = RoIDataModule(loader={"ims_per_batch": 4}, sampling={"aspect_grouping": False})
    assert dm.cfg.TRAIN.IMS_PER_BATCH == 4 and dm.cfg.TRAIN.ASPECT_GROUPING is False
    # the same value in both places is fine; different values are refused, naming both
    assert RoIDataModule(loader={"ims_per_batch": 3},
                         overrides={"TRAIN": {"IMS_PER_BATCH": 3}}).cfg.TRAIN.IMS_PER_BATCH == 3
    with pytest.raises(ValueError, match="loader.ims_per_batch=4.*TRAIN.IMS_PER_BATCH=2"):
        RoIDataModule(loader={"ims_per_batch": 4}, overrides={"TRAIN.IMS_PER_BATCH": 2})
    assert RoIDataModule().seed == RoIDataModule().cfg.RNG_SEED
    assert RoIDataModule(sampling={"seed": 9}).seed == 9


def test_sampler_uses_the_resolved_batch_size(root: Path) -> None:
    dm = DemoRoIDataModule(**dm_kwargs(root, loader={"ims_per_batch": 1},
                                       sampling={"aspect_grouping": False}))
    dm.prepare_data()
    dm.setup("fit")
    sampler = dm.make_sampler()
    assert all(len(b) == 1 for _, b in zip(range(10), iter(sampler)))
    assert sampler.state_dict()["aspect_grouping"] is False


def test_option_range_errors() -> None:
    RoIDataModule(loader={"persistent_workers": True}, sources={"on_bad_image": "skip"})
    with pytest.raises(ValueError, match="epoch_length"):
        RoIDataModule(sampling={"epoch_length": 10})  # only with infinite=true
    with pytest.raises(ValueError, match="epoch_length"):
        RoIDataModule(sampling={"infinite": True, "epoch_length": 0})
    with pytest.raises(ValueError, match="prefetch_factor"):
        RoIDataModule(loader={"prefetch_factor": 0})
    with pytest.raises(ValueError, match="ims_per_batch"):
        RoIDataModule(loader={"ims_per_batch": 0})
    with pytest.raises(ValueError, match="bad_image_reserve"):
        RoIDataModule(sources={"bad_image_reserve": 1.5})


# ------------------------------------------------------------- options that reach the build
def _catalog_file(tmp_path: Path, images: bool) -> Path:
    data = make_coco(3, 4)
    write_dataset(str(tmp_path), "d", data, images=images)
    f = tmp_path / "catalog.yaml"
    f.write_text(f"datasets:\n  d:\n    image_dir: {tmp_path / 'd' / 'images'}\n"
                 f"    annotation_file: {tmp_path / 'd' / 'ann.json'}\n")
    return f


def test_check_images_reaches_the_roidb_build(tmp_path: Path) -> None:
    cat = _catalog_file(tmp_path, images=False)  # annotations only, no image files
    kw = dict(datasets={"train": ["d"]}, loader={"num_workers": 0}, model_type="faster_rcnn")
    src = {"dataset_catalog": str(cat), "cache_dir": str(tmp_path / "c")}
    from lit_roidata.roidb.info import RoIDBInputError

    with pytest.raises(RoIDBInputError, match="images are missing.*check_images=False"):
        RoIDataModule(**kw, sources=src).setup("fit")
    dm = RoIDataModule(**kw, sources=dict(src, check_images=False))
    dm.setup("fit")
    assert len(dm.train_roidb) > 0


def test_category_policy_reaches_the_roidb_build(tmp_path: Path) -> None:
    cat = _catalog_file(tmp_path, images=True)
    src = {"dataset_catalog": str(cat), "cache_dir": str(tmp_path / "c")}
    with pytest.raises(ValueError, match="category_policy='sideways'"):
        RoIDataModule(datasets={"train": ["d"]}, model_type="faster_rcnn",
                      sources=dict(src, category_policy="sideways")).setup("fit")
    dm = RoIDataModule(datasets={"train": ["d"]}, model_type="faster_rcnn",
                       sources=dict(src, category_policy="by_name"))
    dm.setup("fit")
    assert len(dm.train_roidb) > 0


def test_loader_options_reach_the_train_and_eval_loaders(root: Path) -> None:
    dm = DemoRoIDataModule(**dm_kwargs(root, loader={"num_workers": 1, "persistent_workers": True,
                                                     "prefetch_factor": 3},
                                       sampling={"strict_resume": False}))
    dm.prepare_data()
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert loader.persistent_workers and loader._loader.prefetch_factor == 3
    assert loader.strict_resume is False
    ev = dm.val_dataloader()
    assert ev._loader.persistent_workers and ev._loader.prefetch_factor == 3
    # without workers both are dropped (PyTorch refuses them with num_workers=0)
    dm0 = DemoRoIDataModule(**dm_kwargs(root, loader={"num_workers": 0,
                                                      "persistent_workers": True}))
    dm0.setup("fit")
    assert not dm0.train_dataloader().persistent_workers


def test_augment_spec_builds_an_albumentations_pipeline(root: Path) -> None:
    pytest.importorskip("albumentations")
    from lit_roidata.minibatch.augment import Augmentation

    spec = {"transforms": [{"class_path": "RandomBrightnessContrast", "init_args": {"p": 1.0}},
                           {"class_path": "albumentations.ToGray", "init_args": {"p": 1.0}}]}
    dm = DemoRoIDataModule(**dm_kwargs(root), augment=spec)
    dm.setup("fit")
    ds = dm.make_dataset(sampler=dm.make_sampler())
    assert isinstance(ds.augment, Augmentation)
    names = [type(t).__name__ for t in ds.augment.compose.transforms]
    assert names == ["RandomBrightnessContrast", "ToGray"]
    batch = ds.__getitems__(next(iter(dm.make_sampler())))
    plain = DemoRoIDataModule(**dm_kwargs(root))
    plain.setup("fit")
    ref = plain.make_dataset(sampler=plain.make_sampler())
    assert ref.augment is None
    ref_batch = ref.__getitems__(next(iter(plain.make_sampler())))
    data = batch["data"]
    assert data.shape == ref_batch["data"].shape and not torch.equal(data, ref_batch["data"])
    # ToGray: the three channels are equal inside the image
    assert torch.equal(data[:, 0], data[:, 1]) and torch.equal(data[:, 1], data[:, 2])
    with pytest.raises(ValueError, match="no albumentations transform 'NoSuchThing'"):
        DemoRoIDataModule(**dm_kwargs(root), augment={"transforms": [
            {"class_path": "NoSuchThing"}]}).make_augmentation()


# ---------------------------------------------------------------------- DemoRoIDataModule
def test_demo_module_registers_the_demo_and_demo_root_is_its_own(root: Path) -> None:
    dm = DemoRoIDataModule(**dm_kwargs(root))
    assert dm._datasets("train")[0] == ("demo_train_a", "demo_train_b")
    assert dm._datasets("val")[0] == ("demo_val",) and len(dm._datasets("val")[1]) == 1
    assert dm.hparams["demo_root"] == str(root / "data")
    with pytest.raises(TypeError, match="demo_root is an argument of .*DemoRoIDataModule"):
        RoIDataModule(**dm_kwargs(root))
    with pytest.raises(ValueError, match="DemoRoIDataModule"):  # no datasets at all
        RoIDataModule().setup("fit")


# -------------------------------------------------------------------------------- CLI
def test_fit_help_lists_the_data_options(capsys: Any) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--help"])
    assert exc.value.code in (0, None)
    out = capsys.readouterr().out
    for option in ("--data.loader.num_workers", "--data.loader.persistent_workers",
                   "--data.loader.prefetch_factor", "--data.sources.category_policy",
                   "--data.sources.check_images", "--data.sampling.strict_resume",
                   "--data.datasets.train", "--data.output.output_format", "--data.augment",
                   "DemoRoIDataModule"):
        assert option in out, option


def test_nested_options_on_the_command_line(capsys: Any) -> None:
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(REPO / "configs" / "demo.yaml"),
              "--data.loader.num_workers", "0", "--data.sources.check_images", "false",
              "--data.sampling.strict_resume", "false", "--print_config"])
    data = yaml.safe_load(io.StringIO(capsys.readouterr().out))["data"]
    assert data["class_path"] == "lit_roidata.DemoRoIDataModule"
    args = data["init_args"]
    assert args["loader"]["num_workers"] == 0 and args["sources"]["check_images"] is False
    assert args["sampling"]["strict_resume"] is False
    assert args["sources"]["cache_dir"] == "demo_data/cache"  # the rest of the group stays


def test_a_flat_option_on_the_command_line_names_its_nested_key(capsys: Any) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", str(REPO / "configs" / "demo.yaml"), "--data.num_workers", "0",
              "--print_config"])
    assert exc.value.code not in (0, None)
    assert "data.num_workers is now data.loader.num_workers" in capsys.readouterr().err


def test_pin_memory_defaults_to_the_trainer_device() -> None:
    """Unset, ``loader.pin_memory`` pins for a CUDA trainer only (pinned host memory made
    the copy 7x faster on the GPU run behind the default); a set value is kept."""
    import pytorch_lightning as pl

    dm = RoIDataModule()
    assert dm.loader.pin_memory is None and dm.pin_memory() is False  # no trainer
    dm.trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False)
    assert dm.pin_memory() is False

    class _Cuda:  # what a CUDA trainer's strategy reports (no GPU on CI)
        class strategy:  # noqa: N801
            root_device = torch.device("cuda", 0)

    dm.trainer = _Cuda()
    assert dm.pin_memory() is True
    assert RoIDataModule(loader={"pin_memory": False}).pin_memory() is False
    pinned = RoIDataModule(loader={"pin_memory": True})
    pinned.trainer = dm.trainer
    assert pinned.pin_memory() is True
