"""The workloads' framework, apart from the plug-ins in workloads/: the plug-in API (`base`), the resolution of a
workload spec (`loader`: names, the user's files and modules, entry points), and what several workloads share: the
`hf:` configuration readers and checks (`hf_config`, `hf_checks`, `hf_presets`, `hf_moe`) and the data generators
(`captcha_data`, `unet_data`, `text_data`). A plug-in imports the API from `workloads` itself; discovery does not
import this package as one."""
