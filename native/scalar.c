/* Portable scalar build of the kernels (no SIMD target), the type table and the IQ4 codebook.
 * This path runs on any CPU; it dequantizes to float and dots in float (no activation quantization). */
#include "common.h"

const mr_type_info mr_types[GT_COUNT] = {
    [GT_F32] = {1, 4},      [GT_F16] = {1, 2},      [GT_BF16] = {1, 2},
    [GT_Q4_0] = {32, 18},   [GT_Q4_1] = {32, 20},   [GT_Q5_0] = {32, 22},   [GT_Q5_1] = {32, 24},
    [GT_Q8_0] = {32, 34},   [GT_Q2_K] = {256, 84},  [GT_Q3_K] = {256, 110}, [GT_Q4_K] = {256, 144},
    [GT_Q5_K] = {256, 176}, [GT_Q6_K] = {256, 210}, [GT_IQ4_NL] = {32, 18}, [GT_IQ4_XS] = {256, 136},
    [GT_IQ2_XXS] = {256, 66}, [GT_IQ2_XS] = {256, 74}, [GT_IQ2_S] = {256, 82}, [GT_IQ3_XXS] = {256, 98},
    [GT_IQ3_S] = {256, 110},  [GT_IQ1_S] = {256, 50},  [GT_IQ1_M] = {256, 56}, [GT_TQ1_0] = {256, 54},
    [GT_TQ2_0] = {256, 66},   [GT_MXFP4] = {32, 17},
};

const int8_t mr_kvalues_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
const int8_t mr_kvalues_mxfp4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

#define MR_SFX(name) name##_scalar
#include "generic_impl.h"

mr_kernels mr_kernels_scalar;
