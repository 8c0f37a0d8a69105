package config

// DecodeOver decodes one YAML document into v, a pointer to a struct of
// the configuration's types, as strictly as Parse: unknown fields and
// wrong shapes are errors naming the line and the path. Only the fields the
// document names are set, so decoding over a copy of a section overrides
// it field by field. name is quoted in errors.
func DecodeOver(data []byte, name string, v any) error { return decodeStrict(data, name, v) }

// ParseCluster decodes one cluster definition (the value of etcd's
// config/clusters/<name> key) as strictly as Parse, over the defaults of a
// cluster, so it replaces the file's definition of that cluster as a
// whole.
func ParseCluster(data []byte, name string) (Cluster, error) {
	c := defaultCluster()
	if err := decodeStrict(data, name, &c); err != nil {
		return Cluster{}, err
	}
	return c, nil
}
