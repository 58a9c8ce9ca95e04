// Subcommands that live in their own files.
#pragma once

#include <string>
#include <vector>

namespace strata {

int cmd_train(const std::vector<std::string>& argv);
int cmd_profile(const std::vector<std::string>& argv);

}  // namespace strata
