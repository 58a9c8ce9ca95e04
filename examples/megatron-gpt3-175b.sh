#!/bin/bash
# A Megatron-LM launch of the GPT-3 175B run of Megatron-LM's README (TP 8, PP 16 on 128
# DGX A100 nodes, micro-batch 1, global batch 1536, full recompute, fp16), written as such
# scripts are. strata reads it without running it:
#   strata estimate --megatron-args examples/megatron-gpt3-175b.sh --cluster dgx-a100-80g
#   strata plan     --megatron-args examples/megatron-gpt3-175b.sh --cluster dgx-a100-80g
GPUS_PER_NODE=8
NUM_NODES=128

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NUM_NODES
    --master_addr localhost
    --master_port 6000
)
MODEL_ARGS=(
    --num-layers 96
    --hidden-size 12288
    --num-attention-heads 96
    --seq-length 2048
    --max-position-embeddings 2048
    --vocab-size 51200          # Megatron takes it from the tokenizer; strata needs it here
)
TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 1536
    --train-iters 500000
    --lr 6.0e-5
    --min-lr 6.0e-6
    --lr-decay-style cosine
    --clip-grad 1.0
    --fp16
    --recompute-granularity full
    --recompute-method uniform
    --recompute-num-layers 1
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 8
    --pipeline-model-parallel-size 16
)

torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py \
    ${MODEL_ARGS[@]} ${TRAINING_ARGS[@]} ${PARALLEL_ARGS[@]} \
    --data-path "$DATA_PATH" --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE"
