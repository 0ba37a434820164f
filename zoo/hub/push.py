"""``zoo push``: upload a zoo output folder to the Hugging Face Hub with huggingface_hub (create_repo + upload_folder).

Every check (repo id, folder, weights, card, token) runs before the first network call. The only local write is
the model card when the folder has none, written whole and atomically before any upload, so a failed push never
leaves anything half-written. The token comes from huggingface_hub (``HF_TOKEN``, ``hf auth login``) and is only
ever handed to HfApi.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import HfApi, ModelCard, constants, get_token, is_offline_mode
from huggingface_hub.errors import HfHubHTTPError, HFValidationError
from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects, validate_repo_id
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from zoo.hub.card import CARD_NAME, CONFIG_NAME, build_model_card, read_zoo_config, write_model_card
from zoo.plug.spec import check_saved_spec

logger = logging.getLogger(__name__)

# Left out like transformers' Trainer.push_to_hub does: scratch files and intermediate training checkpoints.
IGNORE_PATTERNS = ["_*", "checkpoint-*"]
SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
WEIGHT_FILES = (SINGLE_FILE, INDEX_FILE)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
# The HTTP client's base error (httpx2.HTTPError in huggingface_hub 2.x): connection failures raise it, not OSError.
_CLIENT_HTTP_ERROR = next(c for c in HfHubHTTPError.__mro__[1:] if c.__name__ == "HTTPError")
_HINTS = {
    401: "\nYour token is invalid or expired: run `hf auth login` again or update HF_TOKEN.",
    403: "\nYour token cannot write there: use a token with write access to that user or organization.",
}


class NotHubReadyError(ValueError):
    """The folder would upload something the Hub should not get (pickles) or lacks safetensors weights."""


class PushError(RuntimeError):
    """The push could not happen: no token, offline, the Hub unreachable or refusing."""


@dataclass(frozen=True)
class UploadPlan:
    folder: Path
    repo_id: str
    files: list[tuple[str, int]]  # (path in the repo, size in bytes), as upload_folder will send them
    card: ModelCard
    card_on_disk: bool  # False: the card is generated and written just before the upload


def plan_upload(folder: str | Path, repo_id: str) -> UploadPlan:
    """Check everything that can be checked offline and list what would be uploaded."""
    folder = Path(folder)
    check_repo_id(repo_id)
    check_variant_loads(folder, read_zoo_config(folder))
    files = upload_files(folder)
    check_hub_ready(folder, [path for path, _ in files])
    check_weights_load(folder, [path for path, _ in files])
    card_path = folder / CARD_NAME
    if card_path.is_file():
        return UploadPlan(folder, repo_id, files, _load_card(card_path), card_on_disk=True)
    card = build_model_card(folder, repo_id)
    files = sorted([*files, (CARD_NAME, len(str(card).encode("utf-8")))])
    return UploadPlan(folder, repo_id, files, card, card_on_disk=False)


def check_repo_id(repo_id: str) -> None:
    example = "e.g. my-org/bert-longformer-brown"
    if not isinstance(repo_id, str) or repo_id.count("/") != 1:
        raise ValueError(f"--repo-id {repo_id!r} must have the shape ORG/NAME (user or organization/name), {example}.")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise ValueError(f"--repo-id {repo_id!r} is not a valid Hub repo id: {exc} Use ORG/NAME, {example}.") from exc


def upload_files(folder: Path) -> list[tuple[str, int]]:
    """The files upload_folder sends, with sizes: the same walk and the same filters as huggingface_hub."""
    paths = {p.relative_to(folder).as_posix(): p for p in sorted(folder.glob("**/*")) if p.is_file()}
    kept = filter_repo_objects(paths, ignore_patterns=IGNORE_PATTERNS + DEFAULT_IGNORE_PATTERNS)
    return [(rel, paths[rel].stat().st_size) for rel in kept]


def check_hub_ready(folder: Path, files: list[str]) -> None:
    if not set(files) & set(WEIGHT_FILES):
        raise NotHubReadyError(
            f"{folder} has no model.safetensors. Save the model with model.save_pretrained({str(folder)!r}) "
            "(safetensors is the default) before pushing."
        )
    pickles = [f for f in files if f.endswith(PICKLE_SUFFIXES)]
    if pickles:
        raise NotHubReadyError(
            f"{folder} holds pickle files that would be uploaded: {', '.join(pickles)}. Loading a pickle runs "
            "arbitrary code and the weights are already in model.safetensors: delete these files and push again."
        )


def check_variant_loads(folder: Path, config: dict) -> None:
    """The saved variant is installed here, its parameters are valid and its state is well formed: what
    ``from_pretrained`` checks, so a folder that would not load is never uploaded."""
    try:
        check_saved_spec(config["attention_zoo"], str(folder / CONFIG_NAME))
    except (KeyError, ValueError, ImportError, RuntimeError) as exc:  # unknown, invalid, broken or conflicting
        raise NotHubReadyError(f"{folder / CONFIG_NAME} would not load: {exc}") from exc


def weight_shards(folder: Path, files: list[str]) -> list[str]:
    """The safetensors files from_pretrained reads: model.safetensors, or every shard the index names."""
    if SINGLE_FILE in files:
        return [SINGLE_FILE]
    index = folder / INDEX_FILE
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise NotHubReadyError(
            f"{index} is not a safetensors index (a JSON object with a 'weight_map'): {exc!r}. Save the model again "
            "with model.save_pretrained(folder)."
        ) from exc


def check_weights_load(folder: Path, files: list[str]) -> None:
    """Every weight file is whole: safetensors reads its header and checks each tensor's offsets and byte size
    against the file's length, so a truncated or corrupted file is refused, naming it."""
    for name in weight_shards(folder, files):
        path = folder / name
        if name not in files:
            raise NotHubReadyError(
                f"{folder / INDEX_FILE} names the weight file {name}, which is not in {folder} (or would not be "
                "uploaded). Save the model again with model.save_pretrained(folder)."
            )
        try:
            with safe_open(path, framework="pt") as weights:
                weights.keys()
        except (SafetensorError, OSError) as exc:
            raise NotHubReadyError(
                f"{path} does not load as safetensors ({exc}; {path.stat().st_size:,} bytes on disk): the file is "
                "truncated or corrupted. Save the model again with model.save_pretrained(folder) before pushing."
            ) from exc


def _load_card(path: Path) -> ModelCard:
    try:
        return ModelCard.load(path)
    except ValueError as exc:
        raise NotHubReadyError(
            f"{path} has invalid metadata: {exc}. Fix its YAML front matter, or delete it to get a generated card."
        ) from exc


# ---------------------------------------------------------------------------------------------------
# push


def push_folder(
    folder: str | Path,
    repo_id: str,
    private: bool = True,
    revision: str | None = None,
    commit_message: str | None = None,
    token: str | None = None,
    dry_run: bool = False,
) -> str:
    """Upload ``folder`` to the Hub model repo ``repo_id`` (created if missing); returns the commit URL.

    With ``dry_run`` nothing touches the network or the folder: the plan (files, sizes, card metadata) is printed
    and returned instead.
    """
    plan = plan_upload(folder, repo_id)
    if dry_run:
        text = describe(plan, private, revision)
        print(text)
        return text
    token = token or _find_token()
    if is_offline_mode():
        raise PushError("HF_HUB_OFFLINE is set, so huggingface_hub makes no network calls. Unset it to push.")
    if not plan.card_on_disk:
        logger.info("Writing the model card %s", write_model_card(plan.folder, repo_id))
    config = read_zoo_config(plan.folder)
    message = commit_message or (
        f"Upload {config.get('model_type', 'model')} with attention-zoo variant {config['attention_zoo']['variant']}"
    )
    return _upload(plan, token, private, revision, message)


def _find_token() -> str:
    token = get_token()
    if not token:
        raise PushError(
            "No Hugging Face token found. Log in with `hf auth login`, or set HF_TOKEN to a token with write access "
            "(https://huggingface.co/settings/tokens). `zoo push --dry-run` needs no token."
        )
    return token


def _upload(plan: UploadPlan, token: str, private: bool, revision: str | None, message: str) -> str:
    api = HfApi(token=token)
    try:
        url = api.create_repo(plan.repo_id, private=private, exist_ok=True)
        logger.info("Pushing %s to %s", plan.folder, url)
        if revision and revision != constants.DEFAULT_REVISION:
            api.create_branch(plan.repo_id, branch=revision, exist_ok=True)
        info = api.upload_folder(
            repo_id=plan.repo_id,
            folder_path=plan.folder,
            revision=revision,
            commit_message=message,
            ignore_patterns=list(IGNORE_PATTERNS),
        )
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        raise PushError(f"The Hub refused the push to {plan.repo_id}: {exc}{_HINTS.get(status, '')}") from exc
    except (_CLIENT_HTTP_ERROR, OSError) as exc:  # connection refused, DNS, timeout
        raise PushError(
            f"Could not reach the Hub at {api.endpoint} to push {plan.repo_id}: {exc!r}. The upload changed "
            f"nothing in {plan.folder}; check the connection (and HF_ENDPOINT) and run zoo push again."
        ) from exc
    except ValueError as exc:  # the Hub's validate-yaml rejected the card metadata
        raise PushError(f"The Hub rejected {plan.folder / CARD_NAME}: {exc}") from exc
    return info.commit_url


# ---------------------------------------------------------------------------------------------------
# dry run


def describe(plan: UploadPlan, private: bool, revision: str | None) -> str:
    """The dry-run report: target, every file with its size, the card metadata."""
    visibility = "private" if private else "public"
    lines = [
        "Dry run: nothing is uploaded and nothing is written.",
        f"Would push {plan.folder} to {constants.ENDPOINT}/{plan.repo_id} ({visibility}, "
        f"branch {revision or constants.DEFAULT_REVISION}):",
    ]
    for path, size in plan.files:
        generated = path == CARD_NAME and not plan.card_on_disk
        note = "  (generated model card, written before the upload)" if generated else ""
        lines.append(f"  {size:>13,} B  {tqdm.format_sizeof(size, 'B'):>8}  {path}{note}")
    total = sum(size for _, size in plan.files)
    lines.append(f"  {len(plan.files)} files, {tqdm.format_sizeof(total, 'B')} in all")
    lines += ["Model card metadata (README.md front matter):", "---", plan.card.data.to_yaml(), "---"]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# command line


def add_subcommand(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "push",
        help="upload a fine-tune output folder (safetensors, config, tokenizer, model card) to the Hugging Face Hub",
    )
    p.add_argument("output_dir", type=Path, help="output_dir of a zoo fine-tune (config.json with the variant)")
    p.add_argument("--repo-id", required=True, metavar="ORG/NAME", help="Hub model repo, created if missing")
    visibility = p.add_mutually_exclusive_group()
    visibility.add_argument("--private", dest="private", action="store_true", default=True,
                            help="create the repo private (the default, as the recipes' hub_private: true)")
    visibility.add_argument("--public", dest="private", action="store_false", help="create the repo public")
    p.add_argument("--revision", help="branch to push to, created if missing (default: main)")
    p.add_argument("--commit-message", help="commit message (default names the model type and variant)")
    p.add_argument("--dry-run", action="store_true", help="print the files and card metadata; no network, no writes")
    p.set_defaults(func=cmd_push)


def cmd_push(args: argparse.Namespace) -> int:
    try:
        result = push_folder(
            args.output_dir,
            args.repo_id,
            private=args.private,
            revision=args.revision,
            commit_message=args.commit_message,
            dry_run=args.dry_run,
        )
    except (ValueError, PushError) as exc:
        print(f"zoo push: error: {exc}", file=sys.stderr)
        return 1
    if not args.dry_run:
        print(f"Pushed {args.output_dir} to {result}")
    return 0
