"""GGUF metadata is range-checked as ``config.json`` is: a value that would run and give
nonsense logits is refused when the file is read, naming the file and the metadata key."""

import pytest

from kvjax.model import gguf as kgguf
from tests.test_gguf import write_model


@pytest.mark.parametrize(
  ("edit", "key"),
  [
    (dict(layer_norm_rms_eps=0.0), "llama.attention.layer_norm_rms_epsilon"),
    (dict(head_count_kv=3), "llama.attention.head_count"),
  ],
)
def test_metadata_out_of_range_is_refused_naming_the_key(tmp_path, edit, key):
  path = tmp_path / "m.gguf"
  write_model(path, "llama", **edit)
  with pytest.raises(ValueError, match=key.replace(".", r"\.")) as err:
    kgguf.read(path)
  assert str(path) in str(err.value)
