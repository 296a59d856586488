/* guard_env.c - the objects guards/ reads on its paths (guard_env.h), filled once
 * by module.c at install, next to nns_globals. */
#include "guard_env.h"

GuardEnv guard_env;
