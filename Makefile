# strata: the two commands a user needs.
#   make demo   install deps, build (Release), estimate the published GPT-3 175B plan, search its space,
#               then train tiny-llama for real on 4 MPI ranks
#   make test   install deps, build, run every test; then the same tests under ASan + UBSan
# Extra targets: build, bench (planner), bench-executor (executor speed table), calibration (the per-row
# accuracy table), clean.

JOBS      ?= 2
BUILD     ?= build
SANBUILD  ?= build-asan
CMAKE_ARGS ?=

.PHONY: all deps build demo test test-fast test-sanitize bench bench-executor bench-profile calibration clean

all: build

deps:
	bash scripts/install-deps.sh

build: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_ARGS)
	cmake --build $(BUILD) -j $(JOBS)

demo: build
	@echo; echo "== strata estimate: the published Megatron-LM plan for GPT-3 175B on 1024 A100 (about 32 s measured) =="
	$(BUILD)/strata estimate --model gpt3-175b --cluster dgx-a100-80g --plan examples/megatron-gpt3-1024.plan.json
	@echo; echo "== strata plan: the whole space for the same model, GPUs and batch, against the published plan =="
	$(BUILD)/strata plan --model gpt3-175b --cluster dgx-a100-80g --gpus 1024 --global-batch-size 1536 \
	    --precision fp16 --top 5 --compare examples/megatron-gpt3-1024.plan.json
	@echo; echo "== the Megatron-LM flags of that best plan =="
	$(BUILD)/strata plan --model gpt3-175b --cluster dgx-a100-80g --gpus 1024 --global-batch-size 1536 \
	    --precision fp16 --export megatron
	@echo; echo "== strata train: tiny-llama for real on 4 CPU ranks, tensor x pipeline parallel with sequence parallelism =="
	OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun -np 4 --oversubscribe $(BUILD)/strata train \
	    --model tiny-llama --plan tp=2,pp=2,mbs=2,gbs=8,sp=1 --steps 8

test-fast: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

test-sanitize: deps
	cmake -S . -B $(SANBUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSTRATA_SANITIZE=ON $(CMAKE_ARGS)
	cmake --build $(SANBUILD) -j $(JOBS)
	cd $(SANBUILD) && ctest --output-on-failure -j $(JOBS)

test: test-fast test-sanitize

bench: build
	$(BUILD)/planner_bench

bench-executor: build
	scripts/bench-executor.sh $(BUILD)

bench-profile: build
	scripts/bench-profile.sh $(BUILD) 2
	scripts/bench-profile.sh $(BUILD) 4

calibration: build
	$(BUILD)/calibration_test --gtest_filter='*PublishedRuns*'

clean:
	rm -rf $(BUILD) $(SANBUILD)
