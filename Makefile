# strata: the two commands a user needs.
#   make demo   install deps, build (Release), plan GPT-3 175B on 1024 A100s, then profile this machine,
#               validate tiny-gpt on 2 MPI ranks (predicted against measured) and say where the report is
#   make test   install deps, build, run every test; then the same tests under ASan + UBSan
# Extra targets: build, bench (planner), bench-executor (executor speed table), calibration (the per-row
# accuracy table), fuzz (libFuzzer over the loaders, FUZZ_SECONDS=120), clean.

JOBS      ?= 2
# The Release ctest runs three tests at once on two cores: many of them wait (MPI ranks
# sleeping at a collective, the fault tests' timeouts), and a third fills those gaps (283 s
# against 312 with two, 2026-12-07). The sanitizer ctest's tests wait less and were no
# faster with three (452 s against 436); it runs two (docs/MEASUREMENTS.md).
CTEST_JOBS ?= 3
SAN_CTEST_JOBS ?= 2
BUILD     ?= build
SANBUILD  ?= build-asan
CMAKE_ARGS ?=
# The sanitizer build is compiled by clang (Debian's clang-16, from scripts/install-deps.sh):
# with ASan + UBSan it compiles this code in 55 % of g++ 12's time (the whole build 4.2 min
# against 7.4 on this 2-core machine, docs/MEASUREMENTS.md), and a second compiler's
# warnings and sanitizers check the code. SAN_CXX=g++ builds it with g++. (CMakeLists.txt
# leaves the CUDA backend out of any sanitizer build: nvcc's device code is not
# instrumented; the Release build compiles it and its tests report SKIPPED without a GPU.)
SAN_CXX   ?= clang++-16

.PHONY: all deps build demo test test-fast test-sanitize bench bench-executor bench-profile calibration fuzz clean

all: build

deps:
	bash scripts/install-deps.sh

# Each long phase prints the time of day when it starts, so a slow CI run shows where it went.
build: deps
	@echo "[$$(date +%T)] build: Release in $(BUILD)"
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_ARGS)
	cmake --build $(BUILD) -j $(JOBS)

demo: build
	@echo; echo "== 1. strata plan: GPT-3 175B on 1024 A100-80GB, global batch 1536: the whole space searched, best plans =="
	$(BUILD)/strata plan --model gpt3-175b --cluster dgx-a100-80g --gpus 1024 --global-batch-size 1536 \
	    --precision fp16 --top 5 --compare examples/megatron-gpt3-1024.plan.json
	@echo; echo "== 2+3. strata validate: profile this machine (GEMMs, memory, MPI collectives on 2 ranks), choose the best"
	@echo "==      tiny-gpt plans plus one per mechanism, train each for real under mpirun, compare with the prediction =="
	OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 $(BUILD)/strata validate --model tiny-gpt \
	    --cluster measure --ranks 2 --report strata-report
	@echo; echo "== the report: strata-report/report.md (SVG charts beside it; predicted and measured Chrome traces of"
	@echo "   every plan under strata-report/plans/, open them in https://ui.perfetto.dev) =="

test-fast: build
	@echo "[$$(date +%T)] test: ctest in $(BUILD)"
	cd $(BUILD) && ctest --output-on-failure -j $(CTEST_JOBS)

test-sanitize: deps
	@echo "[$$(date +%T)] build: ASan + UBSan in $(SANBUILD) ($(SAN_CXX))"
	@# (CMake drops every -D but the compiler's when a folder's compiler changes: start afresh.)
	@if [ -f $(SANBUILD)/CMakeCache.txt ] && ! grep -q '^CMAKE_CXX_COMPILER:.*/$(SAN_CXX)$$' $(SANBUILD)/CMakeCache.txt; then \
	  echo "$(SANBUILD) was configured with another compiler: configuring it afresh"; rm -rf $(SANBUILD); fi
	cmake -S . -B $(SANBUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSTRATA_SANITIZE=ON \
	    -DCMAKE_CXX_COMPILER=$(SAN_CXX) $(CMAKE_ARGS)
	@grep -q '^STRATA_SANITIZE:BOOL=ON' $(SANBUILD)/CMakeCache.txt || { echo "$(SANBUILD): not a sanitizer build"; exit 1; }
	cmake --build $(SANBUILD) -j $(JOBS)
	@echo "[$$(date +%T)] test: ctest in $(SANBUILD)"
	cd $(SANBUILD) && ctest --output-on-failure -j $(SAN_CTEST_JOBS)
	@echo "[$$(date +%T)] done"

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

FUZZ_SECONDS ?= 120
fuzz: deps
	scripts/fuzz.sh $(FUZZ_SECONDS)

clean:
	rm -rf $(BUILD) $(SANBUILD)
