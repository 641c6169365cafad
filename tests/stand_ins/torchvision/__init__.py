# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""An import-only stand-in for torchvision, for the Qwen3.5 tests on CPU.

vLLM 0.32.0's Qwen3.5 module imports its Qwen3-VL module, which imports
transformers' Qwen2-VL image processor, which imports torchvision at module
level, even for a text-only model. A CPU build of torchvision cannot be
installed on the project's CI machines (the one their package index has for
torch 2.13 is a CUDA build, which breaks vLLM's CPU flavor: `operator
torchvision::nms does not exist`), so the test that runs Qwen3.5's text models
puts this directory on PYTHONPATH. Every name resolves (submodules, classes, enum members) so that
the imports succeed; calling or instantiating any of them raises. Text
generation never does; users install the real torchvision with vLLM.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+stand-in"


class _Name(type):
    """A class whose every attribute is another such class and that cannot be
    called: InterpolationMode.BILINEAR resolves, decode_image(...) raises."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Name(name, (), {})

    def __call__(cls, *args, **kwargs):
        raise NotImplementedError(
            f"torchvision stand-in (tests/stand_ins): {cls.__name__} is not available")


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Name(name, (), {})


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes every torchvision.* submodule a _Module."""

    def find_spec(self, fullname, path, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
sys.modules[__name__].__class__ = _Module
