"""Datasets for searches: embedded digits (default), CIFAR-10 from a local folder, synthetic tensors."""

from nasdiag.data.datasets import DATASETS, DataError, Splits, cifar10, digits, load_dataset, synthetic

__all__ = ["DATASETS", "DataError", "Splits", "cifar10", "digits", "load_dataset", "synthetic"]
