# Cross build for 64-bit ARM Linux (glibc) with Debian's GCC cross compiler
# (apt: g++-aarch64-linux-gnu), its programs run under qemu-user
# (apt: qemu-user). scripts/aarch64.sh uses it; by hand:
#
#   cmake -S . -B build/aarch64 -G Ninja \
#     -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake \
#     -Dexecutorch_DIR=<the aarch64 executorch wheel, unpacked>/executorch/share/cmake
#
# ctest then runs each test through CMAKE_CROSSCOMPILING_EMULATOR: qemu-aarch64
# with the CPU model in CELLCACHE_QEMU_CPU (default neoverse-n1: ARMv8.2-A with
# NEON, fp16 and dot product, no SVE/SVE2/SME, the core of a Graviton2 or an
# Ampere Altra and a close cousin of a recent phone's big cores; qemu's `max`
# would turn on SVE2 and SME, which XNNPACK's KleidiAI kernels then take, and
# which most devices do not have).
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)

set(_triple aarch64-linux-gnu)
set(CMAKE_C_COMPILER ${_triple}-gcc)
set(CMAKE_CXX_COMPILER ${_triple}-g++)

# Libraries and headers of the target come from the cross toolchain's
# directory and from packages named explicitly (-Dexecutorch_DIR=...); never
# from the build machine.
set(CMAKE_FIND_ROOT_PATH /usr/${_triple})
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)

if(NOT DEFINED CELLCACHE_QEMU_CPU)
  set(CELLCACHE_QEMU_CPU neoverse-n1)
endif()
find_program(CELLCACHE_QEMU qemu-aarch64)
if(CELLCACHE_QEMU)
  # -L: the target's dynamic loader and libraries (libc, libstdc++) live there.
  set(CMAKE_CROSSCOMPILING_EMULATOR ${CELLCACHE_QEMU} -cpu ${CELLCACHE_QEMU_CPU}
      -L /usr/${_triple})
endif()
