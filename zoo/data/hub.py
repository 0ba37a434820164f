"""Any text-classification dataset: a Hub dataset id, or local json / csv / parquet files.

The text and label columns are named in the config; they are renamed to ``text`` and ``label`` and string
labels become a ClassLabel. Missing validation / test splits are carved out of train (stratified).
Examples::

    task_options: {path: imdb, text_column: text, label_column: label}
    task_options: {path: json, data_files: {train: a.jsonl, test: b.jsonl}, text_column: body, label_column: topic}
"""

from __future__ import annotations

import datasets


def build(
    path: str | None = None,
    name: str | None = None,
    data_files: str | list | dict | None = None,
    text_column: str = "text",
    label_column: str = "label",
    validation_size: float = 0.1,
    test_size: float = 0.1,
    seed: int = 0,
    revision: str | None = None,
) -> datasets.DatasetDict:
    if path is None:
        raise ValueError(
            "task 'hub' needs task_options.path: a Hub dataset id (e.g. 'imdb') or a file format "
            "('json', 'csv', 'parquet') together with task_options.data_files."
        )
    loaded = datasets.load_dataset(path, name, data_files=data_files, revision=revision)
    if not isinstance(loaded, datasets.DatasetDict):
        loaded = datasets.DatasetDict({"train": loaded})
    loaded = select_columns(loaded, text_column, label_column)
    return complete_splits(loaded, validation_size, test_size, seed)


def select_columns(dataset: datasets.DatasetDict, text_column: str, label_column: str) -> datasets.DatasetDict:
    for role, column in (("text", text_column), ("label", label_column)):
        for split, part in dataset.items():
            if column not in part.column_names:
                raise ValueError(
                    f"hub dataset split {split!r} has no {role} column {column!r}; its columns are "
                    f"{', '.join(part.column_names)}. Set task_options.{role}_column to one of them."
                )
    dataset = dataset.select_columns([text_column, label_column])
    if text_column != "text":
        dataset = dataset.rename_column(text_column, "text")
    if label_column != "label":
        dataset = dataset.rename_column(label_column, "label")
    if not isinstance(dataset["train"].features["label"], datasets.ClassLabel):
        dataset = dataset.class_encode_column("label")
    return dataset


def complete_splits(dataset: datasets.DatasetDict, validation_size: float, test_size: float, seed: int):
    if "train" not in dataset:
        raise ValueError(f"hub dataset has no 'train' split (splits: {', '.join(dataset)}).")
    splits = dict(dataset)
    for split, size in (("test", test_size), ("validation", validation_size)):
        if split not in splits:
            parts = splits["train"].train_test_split(test_size=size, stratify_by_column="label", seed=seed)
            splits["train"], splits[split] = parts["train"], parts["test"]
    return datasets.DatasetDict(splits)
