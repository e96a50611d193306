"""Megatron-LM's ``tests/unit_tests/test_utilities.Utils`` for the CPU: gloo instead of NCCL, the
rank and world size from torchrun's environment (one rank without it), and megatron_ga_ext's CPU
shims for the process (megatron-core allocates on "cuda" and builds FSDP2's mesh there)."""

import contextlib
import os
import socket

import torch
import torch.distributed

from megatron_ga_ext.testing.shims import cpu_shims

_SHIMS = contextlib.ExitStack()


def _free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


class Utils:
    """The subset of upstream's Utils these tests use, same names and signatures."""

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))

    @staticmethod
    def initialize_distributed():
        if torch.distributed.is_initialized():
            return
        _SHIMS.enter_context(cpu_shims())
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", _free_port())
        torch.distributed.init_process_group(
            backend="gloo", world_size=Utils.world_size, rank=Utils.rank
        )
        torch.distributed.barrier()

    @staticmethod
    def initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        **kwargs,
    ):
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        ps.destroy_model_parallel()
        Utils.initialize_distributed()
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tensor_model_parallel_size,
            pipeline_model_parallel_size=pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
            **kwargs,
        )
        model_parallel_cuda_manual_seed(123)

    @staticmethod
    def destroy_model_parallel():
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        torch.distributed.barrier()
