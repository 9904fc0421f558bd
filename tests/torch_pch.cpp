// The translation unit that builds the tests' shared precompiled <torch/torch.h> (tests/CMakeLists.txt).
