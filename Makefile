# Docker images of ft (docker/README.md). Tags follow the package version in finetune/__init__.py:
#   $(IMAGE):VERSION-cpu                              the CPU image
#   $(IMAGE):VERSION-cuXYZ-torchA.B                   the CUDA image (CUDA X.Y, torch A.B)
#   $(IMAGE):VERSION-cuXYZ-torchA.B-vllmC.D.E         the CUDA image with vLLM (on VLLM_CUDA_VERSION)
# Override on the command line, e.g. make image-cuda CUDA_VERSION=13.0.2 IMAGE=registry.example/ft
# CUDA_VERSION: 12.x runs on drivers from R525 on, 13.x needs R580 (docker/README.md, Drivers). vLLM's wheels are
# built for CUDA 13, so the vLLM image has its own VLLM_CUDA_VERSION; docker/Dockerfile refuses another major.

IMAGE ?= ft
DOCKER ?= docker
HADOLINT ?= $(firstword $(wildcard .venv/bin/hadolint) hadolint)
CUDA_VERSION ?= 12.8.1
VLLM_CUDA_VERSION ?= 13.0.2
TORCH_VERSION ?= 2.13.0
DOCKER_BUILD_ARGS ?=

VERSION := $(shell sed -n 's/^__version__ = "\(.*\)"/\1/p' finetune/__init__.py)
cuda_tag = cu$(word 1,$(subst ., ,$(1)))$(word 2,$(subst ., ,$(1)))
CUDA_TAG := $(call cuda_tag,$(CUDA_VERSION))
VLLM_CUDA_TAG := $(call cuda_tag,$(VLLM_CUDA_VERSION))
TORCH_TAG := torch$(word 1,$(subst ., ,$(TORCH_VERSION))).$(word 2,$(subst ., ,$(TORCH_VERSION)))
VLLM_VERSION := $(shell sed -n 's/^vllm==//p' docker/constraints-vllm.txt)

CPU_IMAGE := $(IMAGE):$(VERSION)-cpu
CUDA_IMAGE := $(IMAGE):$(VERSION)-$(CUDA_TAG)-$(TORCH_TAG)
VLLM_IMAGE := $(IMAGE):$(VERSION)-$(VLLM_CUDA_TAG)-$(TORCH_TAG)-vllm$(VLLM_VERSION)

BUILD := $(strip $(DOCKER) build --build-arg FT_VERSION=$(VERSION) --build-arg TORCH_VERSION=$(TORCH_VERSION) $(DOCKER_BUILD_ARGS))

.PHONY: images image-cpu image-cuda image-vllm push print-tags lint-docker check-cpu-install

images: image-cpu image-cuda image-vllm

image-cpu:
	$(BUILD) -f docker/Dockerfile.cpu -t $(CPU_IMAGE) .

image-cuda:
	$(BUILD) --build-arg CUDA_VERSION=$(CUDA_VERSION) -f docker/Dockerfile --target runtime -t $(CUDA_IMAGE) .

image-vllm:
	$(BUILD) --build-arg CUDA_VERSION=$(VLLM_CUDA_VERSION) -f docker/Dockerfile --target vllm -t $(VLLM_IMAGE) .

push:
	$(DOCKER) push $(CPU_IMAGE)
	$(DOCKER) push $(CUDA_IMAGE)
	$(DOCKER) push $(VLLM_IMAGE)

print-tags:
	@echo $(CPU_IMAGE)
	@echo $(CUDA_IMAGE)
	@echo $(VLLM_IMAGE)

lint-docker:
	$(HADOLINT) docker/Dockerfile docker/Dockerfile.cpu
	bash -n docker/entrypoint.sh

check-cpu-install:
	bash docker/check-cpu-install.sh
