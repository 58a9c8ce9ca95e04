// STRATA_ASAN: defined where this translation unit is compiled with AddressSanitizer, under
// either compiler (g++ defines __SANITIZE_ADDRESS__; clang 16, which make test's sanitizer
// build uses, answers __has_feature(address_sanitizer) instead), with its interface
// (<sanitizer/asan_interface.h>: poisoning, region checks) included.
#pragma once

#if defined(__SANITIZE_ADDRESS__)
#define STRATA_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define STRATA_ASAN 1
#endif
#endif

#if defined(STRATA_ASAN)
#include <sanitizer/asan_interface.h>
#endif
