"""Label values: always valid, GFD-compatible for ordinary names, never colliding."""

import itertools

import pytest

from gpudaemon.labels.sanitize import Labels, is_valid_value, sanitize_value

NAMES = [
    "NVIDIA H100 80GB HBM3",
    "NVIDIA A100-SXM4-80GB",
    "NVIDIA H100 80GB HBM3 (SXM)",
    "NVIDIA H100 80GB HBM3 [SXM]",
    "NVIDIA H100 80GB HBM3 {SXM}",
    "Tesla V100-PCIE-16GB/rev.2",
    "GeForce RTX 4090 (Founders Edition)!",
    "  leading and trailing spaces  ",
    "-dash-first",
    "ünïcödé GPU™",
    "x" * 63,
    "x" * 64,
    "y" * 300,
    "NVIDIA " + "Very Long Product Name " * 5 + "A",
    "NVIDIA " + "Very Long Product Name " * 5 + "B",
    "___",
    "",
    "a:b",
    "a;b",
]


@pytest.mark.parametrize("name", NAMES)
def test_every_name_yields_a_valid_label_value(name: str) -> None:
    v = sanitize_value(name)
    assert is_valid_value(v), (name, v)


def test_distinct_names_never_collide() -> None:
    cleaned = {sanitize_value(n): n for n in NAMES}
    assert len(cleaned) == len(NAMES)
    for a, b in itertools.combinations(NAMES, 2):
        assert sanitize_value(a) != sanitize_value(b), (a, b)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", "NVIDIA-H100-80GB-HBM3"),  # the brief's nodeSelector value
        ("NVIDIA A100-SXM4-80GB", "NVIDIA-A100-SXM4-80GB"),
        (True, "true"),
        (False, "false"),
        (81559, "81559"),
        ("x" * 63, "x" * 63),
    ],
)
def test_ordinary_values_clean_like_gpu_feature_discovery(raw: object, expected: str) -> None:
    assert sanitize_value(raw) == expected


def test_lossy_cleaning_is_marked_with_a_hash_and_is_stable() -> None:
    v = sanitize_value("NVIDIA H100 (SXM)")
    assert v.startswith("NVIDIA-H100-SXM-") and len(v) == len("NVIDIA-H100-SXM-") + 8
    assert sanitize_value("NVIDIA H100 (SXM)") == v


def test_labels_refuse_invalid_names_and_prefixes() -> None:
    with pytest.raises(ValueError):
        Labels("gpudaemon.io/", {"bad name!": "x"})
    with pytest.raises(ValueError):
        Labels("Not A Prefix", {"gpu.count": 1})
    assert dict(Labels("example.com/", {"gpu.count": 8})) == {"example.com/gpu.count": "8"}


def test_space_and_hyphen_are_the_same_character_by_design() -> None:
    """GFD-compatible values win over telling "A B" from "A-B": no real GPU name pair
    differs only there, and every nodeSelector written for GFD keeps working."""
    assert sanitize_value("NVIDIA H100 80GB HBM3") == sanitize_value("NVIDIA-H100-80GB-HBM3")
    assert sanitize_value("NVIDIA H100 80GB HBM3") != sanitize_value("NVIDIA H100 80GB HBM3 ")
    assert sanitize_value("NVIDIA H100 80GB HBM3") != sanitize_value("NVIDIA_H100_80GB_HBM3")
