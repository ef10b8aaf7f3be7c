"""Audit of tokenring.hf by a regression sweep over transformers' causal LM, masked LM, token
classification and question answering heads (tiny configs, float64, forward and backward with
and without labels, return_dict=False too, on 2 ranks and on 3 with uneven shards, against one
process with SDPA): what it found that the sweep of tests/test_hf_sweep_audit.py did not.

Legend: B batch, S global seq, P world size.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install 'tokenring-attention[hf]')"
)
from transformers import AutoConfig  # noqa: E402

from tokenring import hf  # noqa: E402

SEQ = 12
VOCAB = 64
BERT_SIZES = dict(
    vocab_size=VOCAB, max_position_embeddings=64, hidden_size=32, intermediate_size=48,
    num_hidden_layers=2, num_attention_heads=4, embedding_size=32, pad_token_id=0,
)  # fmt: skip


def _mobilebert(head: str) -> Any:
    config = AutoConfig.for_model("mobilebert", **BERT_SIZES)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model = getattr(transformers, f"MobileBertFor{head}")._from_config(
            config, attn_implementation="tokenring"
        )
    return model.double().eval()


# MobileBERT's embeddings (trigram_input=True, its default) concatenate each token's embedding
# with its two neighbours' before the first layer: a convolution of width 3 over the sequence
# in plain tensor code, which tokenring's checks did not see. On 2 ranks each shard's edge
# tokens saw zeros for their neighbours on the other rank: MobileBertForTokenClassification's
# logits 0.06 off one process and its gradients 0.79 off (relative), MobileBertForQuestion-
# Answering's 0.06 and 0.68, with no error
@pytest.mark.usefixtures("single_rank_group")
@pytest.mark.parametrize("head", ["TokenClassification", "QuestionAnswering", "MaskedLM"])
def test_mobilebert_trigram_embeddings_are_refused(head: str) -> None:
    """NotImplementedError naming trigram_input, from the mask function (every rank alike:
    it reads the config) and from check_model."""
    hf.register()
    model = _mobilebert(head)
    sp = hf.SequenceParallel()
    batch = hf.shard_batch(sp, torch.randint(3, VOCAB, (2, SEQ)))
    refused = "cannot split model_type 'mobilebert'.*trigram_input"
    with pytest.raises(NotImplementedError, match=refused):
        model(input_ids=batch.input_ids, position_ids=batch.position_ids, sequence_parallel=sp)
    with pytest.raises(NotImplementedError, match=refused):
        hf.check_model(model)
